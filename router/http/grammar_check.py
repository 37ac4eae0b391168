"""Grammars compiled at the router, as the shard will compile them, so that a grammar the shard
would refuse (a regex that does not parse, a schema of an unknown type) or that allows no token at
all (`[^\\s\\S]`) is a 422 for its own request instead of a failed prefill of a whole batch.

The compiler is the shard's (engine/grammar.py, xgrammar) over the router's tokenizer; it caches
compiled grammars, so a grammar sent again costs nothing. Without xgrammar the router leaves the
check to the shard.
"""

from __future__ import annotations

import threading

from engine.batch import GrammarType
from engine.errors import InvalidRequestError
from router.http.validation import ValidationError


class GrammarCheck:
    """`on_shard_thread(fn)`, where the shard runs in this process: fn's result, computed on the
    shard's worker thread. The compiler's torch calls then open no second OpenMP thread pool
    (engine/cli/main.py on_a_passing_thread says what a second pool costs every step)."""

    def __init__(self, tokenizer, on_shard_thread=None):
        self.tokenizer, self.on_shard_thread = tokenizer, on_shard_thread
        self._compiler, self._failed = None, False
        self._lock = threading.Lock()

    def _get(self):
        with self._lock:  # the first requests may arrive together on the validation threads
            if self._compiler is None and not self._failed:
                try:
                    from engine.grammar import GrammarCompiler
                except ImportError:
                    self._failed = True
                    return None
                eos = self.tokenizer.eos_token_id
                if eos is None:  # the compiler needs an end: leave the check to the shard
                    self._failed = True
                    return None
                self._compiler = GrammarCompiler(
                    self.tokenizer, len(self.tokenizer), frozenset([eos])
                )
            return self._compiler

    def __call__(
        self, grammar: str, grammar_type: GrammarType, reasoning: tuple[str, str] = ("", "")
    ) -> None:
        # Most requests have no grammar: they must not wait for the compiler, whose first build
        # (xgrammar and torch imported, the vocabulary decoded) took 0.4-1.7 s.
        if grammar_type == GrammarType.NONE:
            return
        if self.on_shard_thread is not None:
            return self.on_shard_thread(lambda: self._check(grammar, grammar_type, reasoning))
        self._check(grammar, grammar_type, reasoning)

    def prepare(self) -> None:
        """Build the compiler now rather than on the first grammar request."""
        self._get()

    def _check(self, grammar: str, grammar_type: GrammarType, reasoning: tuple[str, str]) -> None:
        compiler = self._get()
        if compiler is None:
            return
        try:
            compiled = compiler.compile(grammar_type, grammar, reasoning=reasoning)
        except InvalidRequestError as error:
            raise ValidationError(str(error).replace("parameters.grammar", "`grammar`")) from None
        if not compiler.new_state(compiled).allowed_mask().any():
            raise ValidationError("`grammar` matches no text: it allows no token at all")
