"""Grammar-constrained decoding for TGI's `grammar` parameter (GRAMMAR_TYPE_JSON and
GRAMMAR_TYPE_REGEX).

The constraint is xgrammar's: its compiler turns a JSON schema or a regex into a pushdown automaton
over the tokenizer's vocabulary (byte-level, byte-fallback and raw vocabularies are detected from
the Hugging Face tokenizer), and one matcher per request walks it token by token and writes the
next-token bitmask. This module only adapts that to the shard:

- GrammarCompiler: built once per shard for one tokenizer and one logits vocabulary size; compiles
and caches
  grammars by (type, text) and turns xgrammar's errors into InvalidRequestError naming
  `parameters.grammar`.
- GrammarState: one per request, kept on its Sequence. All of a request's grammar state is in it
(there is no
  batch-level state), so filtering and concatenating batches need nothing from this module.
- fill_masks: the bool [n, vocab] `allowed` rows of a batch in one call, for
sampling.choose(allowed=...).

Semantics (as TGI with outlines): the whole generated text must match the grammar, unless the
request names a reasoning block (after_reasoning): then the text up to the block's closing tag is
free and the grammar constrains the answer after it. A JSON schema is compiled in
strict mode (no properties beyond those listed) with compact separators, ", " and ": ", so that a
sampler cannot spend its tokens on whitespace; a schema keyword that the grammar cannot enforce is
refused (engine/grammar_schema.py lists the supported ones), and no JSON string can hold a raw
control character (json_schema_ebnf). Once the text matches completely the EOS tokens become
allowed, and when nothing else can follow they are the only allowed tokens. Token ids past the
tokenizer's vocabulary (padding of the logits) and special tokens other than EOS are never allowed.

Generated text is always valid UTF-8. xgrammar 0.2.9's character classes (a negated class, `.`, a
range up to U+10FFFF) also take the UTF-8 encodings of the surrogates U+D800-U+DFFF, the bytes ED
A0-BF xx, which no decoder accepts (the client sees U+FFFD, and a `maxLength` string decodes one
character longer per byte). So every mask drops the tokens that would write such a sequence
(_utf8_filters): the few holding ED A0-BF inside, and after a token ending in the lead byte ED those
starting with A0-BF.
"""

from __future__ import annotations

import json
import logging
import os
import re
import sys
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
import torch
import xgrammar

from engine.batch import GrammarType
from engine.errors import InvalidRequestError
from engine.grammar_schema import UnsupportedSchema, check_schema, patterns

log = logging.getLogger(__name__)

FIELD = "parameters.grammar"
DEFAULT_CACHE_SIZE = 256  # compiled grammars kept per shard (least recently used dropped first)

# xgrammar's C++ errors read "[03:34:49] /project/cpp/regex_converter.cc:94: Regex parsing error
# ...": the user gets the part after the source location.
_CPP_PREFIX = re.compile(
    r"^(\[[0-9:]+\]\s*)?\S+\.(cc|h|cpp):\d+:\s*(Check failed: .*? is false: )?"
)


@dataclass(frozen=True, eq=False)
class CompiledGrammar:
    """A grammar compiled for one GrammarCompiler's vocabulary. Immutable and shared by all requests
    using it."""

    grammar_type: GrammarType
    grammar: str
    reasoning: tuple[str, str]  # the block before the answer (after_reasoning); ("", ""): none
    _compiled: xgrammar.CompiledGrammar = field(repr=False)
    _owner: GrammarCompiler = field(repr=False)

    @property
    def memory_bytes(self) -> int:
        return self._compiled.memory_size_bytes


class GrammarCompiler:
    """Compiles grammars for one tokenizer and one logits vocabulary size; one per shard."""

    def __init__(
        self,
        tokenizer,
        vocab_size: int,
        eos_token_ids: frozenset[int],
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        max_threads: int | None = None,
    ):
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        stop = sorted(i for i in eos_token_ids if 0 <= i < vocab_size)
        if not stop:
            raise ValueError(
                f"no EOS token id among {sorted(eos_token_ids)} is below vocab_size {vocab_size}"
            )
        self.vocab_size = vocab_size
        self.eos_token_ids = frozenset(stop)
        self._info = xgrammar.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop
        )
        threads = max_threads or min(8, os.cpu_count() or 1)
        # xgrammar's own cache is keyed the same way; ours returns the very same object and bounds
        # the count.
        self._xgr = xgrammar.GrammarCompiler(self._info, max_threads=threads, cache_enabled=False)
        self._cache: OrderedDict[tuple, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.bitmask_words = (vocab_size + 31) // 32
        self._utf8_filters = _utf8_filters(self._info.decoded_vocab, self.bitmask_words)
        self._ends_in_surrogate_lead = _ends_in(self._info.decoded_vocab, _SURROGATE_LEAD)
        self._eos_only_bits = _pack([*stop], self.bitmask_words)  # int32 [words]
        self._eos_only_mask = torch.zeros(vocab_size, dtype=torch.bool)
        self._eos_only_mask[stop] = True

    def compile(
        self, grammar_type: GrammarType, grammar: str, *, reasoning: tuple[str, str] = ("", "")
    ) -> CompiledGrammar:
        """The compiled grammar, from the cache when this (type, text, reasoning) was compiled
        before. `reasoning`: (opening tag, closing tag) of a block before the answer, see
        after_reasoning; an empty closing tag: none."""
        try:
            grammar_type = GrammarType(grammar_type)
        except ValueError:
            raise InvalidRequestError(
                f"parameters.grammar_type: unknown grammar type {grammar_type!r}"
            ) from None
        if grammar_type == GrammarType.NONE:
            raise InvalidRequestError(
                "parameters.grammar_type: GRAMMAR_TYPE_NONE has no grammar to compile"
            )
        if not isinstance(grammar, str):
            raise InvalidRequestError(f"{FIELD}: must be a string, got {type(grammar).__name__}")
        reasoning = _reasoning_tags(reasoning)
        key = (grammar_type, grammar, reasoning)
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                return hit
            compiled = CompiledGrammar(
                grammar_type,
                grammar,
                reasoning,
                self._compile(grammar_type, grammar, reasoning),
                self,
            )
            self._cache[key] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
            return compiled

    def _compile(
        self, grammar_type: GrammarType, grammar: str, reasoning: tuple[str, str]
    ) -> xgrammar.CompiledGrammar:
        if grammar_type == GrammarType.JSON:
            try:
                schema = json.loads(grammar)
            except ValueError as e:
                raise InvalidRequestError(f"{FIELD}: invalid JSON schema: not JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequestError(
                    f"{FIELD}: invalid JSON schema: must be an object or a boolean, "
                    f"got {type(schema).__name__}"
                )
            try:
                ebnf = json_schema_ebnf(schema)
                if reasoning[1]:
                    answer = {"type": "grammar", "grammar": ebnf}
                    return self._xgr.compile_structural_tag(after_reasoning(answer, *reasoning))
                return self._xgr.compile_grammar(ebnf)
            except UnsupportedSchema as e:
                raise InvalidRequestError(f"{FIELD}: {e}") from None
            except (RuntimeError, ValueError, TypeError) as e:
                raise InvalidRequestError(f"{FIELD}: invalid JSON schema: {_clean(e)}") from None
        try:
            if reasoning[1]:
                answer = {"type": "regex", "pattern": grammar}
                return self._xgr.compile_structural_tag(after_reasoning(answer, *reasoning))
            return self._xgr.compile_regex(grammar)
        except (RuntimeError, ValueError, TypeError) as e:
            raise InvalidRequestError(f"{FIELD}: invalid regex: {_clean(e)}") from None

    def new_state(self, compiled: CompiledGrammar) -> GrammarState:
        """A fresh per-request state at the start of `compiled`."""
        if not isinstance(compiled, CompiledGrammar):
            raise TypeError(f"expected a CompiledGrammar, got {type(compiled).__name__}")
        if compiled._owner is not self:
            raise ValueError("the grammar was compiled by another GrammarCompiler")
        return GrammarState(self, compiled, xgrammar.GrammarMatcher(compiled._compiled))

    def cache_len(self) -> int:
        return len(self._cache)


class GrammarState:
    """One request's position in its grammar. Copies (copy.copy, copy.deepcopy, fork) are
    independent."""

    __slots__ = (
        "_compiler",
        "compiled",
        "_matcher",
        "_bits",
        "_finished",
        "failed",
        "tokens",
        "_after_lead",
    )

    def __init__(
        self, compiler: GrammarCompiler, compiled: CompiledGrammar, matcher: xgrammar.GrammarMatcher
    ):
        self._compiler = compiler
        self.compiled = compiled
        self._matcher = matcher
        self._bits = torch.empty(1, compiler.bitmask_words, dtype=torch.int32)
        self._finished: bool | None = (
            None  # cached is_finished, None: not computed since the last advance
        )
        self.failed = False  # advance() got a token the grammar forbids
        self.tokens = 0  # tokens consumed
        self._after_lead = False  # the text so far ends in ED, the lead byte of U+D000-U+DFFF

    @property
    def vocab_size(self) -> int:
        return self._compiler.vocab_size

    @property
    def terminated(self) -> bool:
        """An EOS token was consumed after a complete match (or the grammar was broken): only EOS is
        allowed."""
        return self.failed or self._matcher.is_terminated()

    def allowed_mask(self) -> torch.Tensor:
        """bool [vocab_size], True where the token may come next. A new tensor each call."""
        if self.terminated:
            return self._compiler._eos_only_mask.clone()
        self._matcher.fill_next_token_bitmask(self._bits)
        self._bits &= self._compiler._utf8_filters[int(self._after_lead)]
        return _unpack(self._bits, self.vocab_size)[0].contiguous()

    def advance(self, token_id: int) -> None:
        """Consume a generated token.

        A token the grammar forbids (the caller did not apply the mask) does not raise, since one
        request must not fail its batch: the state is marked `failed`, logged, and from then on
        allows only EOS and reports is_finished, so the request ends. EOS after EOS is ignored.
        """
        token_id = int(token_id)
        self._finished = None
        if self.terminated:
            if token_id not in self._compiler.eos_token_ids and not self.failed:
                self._fail(token_id, "after the grammar's end")
            return
        if not self._matcher.accept_token(token_id):
            self._fail(token_id, f"at token {self.tokens}")
            return
        self.tokens += 1
        ends_in = self._compiler._ends_in_surrogate_lead
        if token_id < len(ends_in) and ends_in[token_id] is not None:  # None: no bytes (special)
            self._after_lead = ends_in[token_id]

    def _fail(self, token_id: int, where: str) -> None:
        self.failed = True
        log.warning(
            "grammar %s: token %d is not allowed %s; the request can only end now",
            self.compiled.grammar_type.name,
            token_id,
            where,
        )

    @property
    def is_complete(self) -> bool:
        """What was consumed is a complete match (more may still follow, e.g. for `a+`)."""
        return self.terminated or self._matcher.is_completed()

    @property
    def is_finished(self) -> bool:
        """A complete match was consumed and nothing but EOS can follow."""
        if self._finished is None:
            if self.terminated:
                self._finished = True
            elif not self._matcher.is_completed():
                self._finished = False
            else:
                self._matcher.fill_next_token_bitmask(self._bits)
                self._finished = torch.equal(self._bits[0], self._compiler._eos_only_bits)
        return self._finished

    def fork(self) -> GrammarState:
        """An independent copy at the same position (e.g. for n > 1 or speculative branches)."""
        twin = GrammarState(self._compiler, self.compiled, self._matcher.fork())
        twin._finished, twin.failed, twin.tokens = self._finished, self.failed, self.tokens
        twin._after_lead = self._after_lead
        return twin

    def __copy__(self) -> GrammarState:
        return self.fork()

    def __deepcopy__(self, memo) -> GrammarState:
        return self.fork()

    def __repr__(self) -> str:
        return (
            f"GrammarState({self.compiled.grammar_type.name}, tokens={self.tokens}, "
            f"finished={self.is_finished}, failed={self.failed})"
        )


def fill_masks(states: Sequence[GrammarState | None], out: torch.Tensor) -> torch.Tensor:
    """Fill out[i] (bool, [>= len(states), vocab_size]) with states[i]'s allowed tokens; a None row
    allows all.

    All live matchers are filled by xgrammar in one multithreaded call and unpacked at once; rows
    past len(states) are left alone. `out` may live on any device. Returns `out`.
    """
    n = len(states)
    if out.dtype != torch.bool or out.dim() != 2 or out.shape[0] < n:
        raise ValueError(f"out must be bool [>= {n}, vocab], got {out.dtype} {tuple(out.shape)}")
    if n == 0:
        return out
    live = [s for s in states if s is not None]
    if not live:
        out[:n] = True
        return out
    compiler = live[0]._compiler
    if any(s._compiler is not compiler for s in live):
        raise ValueError("fill_masks: states from different GrammarCompilers")
    if out.shape[1] != compiler.vocab_size:
        raise ValueError(
            f"out has {out.shape[1]} columns, the grammars' vocab_size is {compiler.vocab_size}"
        )
    bits = torch.empty(n, compiler.bitmask_words, dtype=torch.int32)
    matchers, rows, after_lead = [], [], []
    for i, s in enumerate(states):
        if s is None:
            bits[i] = -1
        elif s.terminated:
            bits[i] = compiler._eos_only_bits
        else:
            matchers.append(s._matcher)
            rows.append(i)
            after_lead.append(int(s._after_lead))
    if len(matchers) == 1:
        matchers[0].fill_next_token_bitmask(bits, rows[0])
    elif matchers:
        _batch_matcher().batch_fill_next_token_bitmask(matchers, bits, rows)
    if matchers:
        bits[rows] &= compiler._utf8_filters[after_lead]
    mask = _unpack(bits, compiler.vocab_size)
    if out.device.type == "cpu" and out.is_contiguous():
        np.copyto(
            out[:n].numpy(), mask.numpy()
        )  # numpy's copy: no torch intra-op threads to wait for
    else:
        out[:n].copy_(mask)
    return out


def allowed_masks(states: Sequence[GrammarState | None], vocab_size: int) -> torch.Tensor | None:
    """The `allowed` argument of sampling.choose for a batch: None when no row has a grammar."""
    if all(s is None for s in states):
        return None
    return fill_masks(states, torch.empty(len(states), vocab_size, dtype=torch.bool))


@lru_cache(maxsize=1)
def _batch_matcher() -> xgrammar.BatchGrammarMatcher:
    # "auto" sizes xgrammar's pool from the cores; a fixed count above what is free (2 threads on a
    # busy 2-core machine) made an 8-row fill take milliseconds instead of ~50 us.
    return xgrammar.BatchGrammarMatcher(max_threads="auto")


# xgrammar 0.2.9 writes a string bounded by minLength / maxLength as repeats of this class, which
# lets raw control characters (U+0000-U+001F) into the JSON string (mlc-ai/xgrammar#800). The
# rule is matched as a whole line, so no string literal of the grammar (always quoted) can be
# rewritten.
_BOUNDED_CHARACTERS = re.compile(r'^(\S+) ::= \(\(\[\^\\"\\\\\\r\\n\]\)\)$', re.MULTILINE)
_JSON_STRING_CHARACTER = r'\1 ::= (([^\\0-\\x1f\\"\\\\]))'


def json_schema_ebnf(schema: dict | bool) -> str:
    """The grammar of a JSON schema, in xgrammar's EBNF: xgrammar's conversion (strict, compact
    separators), with every string character class excluding what JSON must escape.

    Raises UnsupportedSchema for a keyword that the grammar would not enforce
    (engine/grammar_schema.py)."""
    check_schema(schema)
    for pattern in patterns(schema):
        _check_pattern_path(pattern)
    text = json.dumps(schema)
    converted = str(xgrammar.Grammar.from_json_schema(text, any_whitespace=False, strict_mode=True))
    return _BOUNDED_CHARACTERS.sub(_JSON_STRING_CHARACTER, converted)


@lru_cache(maxsize=1024)
def _check_pattern_path(pattern: str) -> None:
    # xgrammar compiles a pattern with JSON's string characters excluded; when that leaves nothing
    # to match (a pattern that needs a control character or a quote) it falls back to the pattern
    # as written, which can break the JSON string: refuse those.
    schema = json.dumps({"type": "string", "pattern": pattern})
    try:
        converted = str(
            xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
        )
    except (RuntimeError, ValueError, TypeError):
        return  # the whole schema's conversion reports it
    if "json_string=true" not in converted:
        raise UnsupportedSchema(
            f"JSON schema `pattern` {pattern!r} cannot match inside a JSON string "
            "without characters that JSON must escape"
        )


# Between a reasoning block's closing tag and the answer, the whitespace models write there
# (Qwen3: a blank line); bounded, so that a sampler cannot spend its tokens on it.
_AFTER_REASONING = {"type": "regex", "pattern": "[ \\t\\r\\n]{0,4}"}


def after_reasoning(answer: dict, start: str, end: str) -> str:
    """An xgrammar structural tag (JSON): a reasoning block, then `answer` (a structural-tag
    format). The block is any text up to the closing tag `end`; with an opening tag `start` it is
    optional and opens with it, without one the text starts inside it. One automaton over the
    text, so a tag spelled in several tokens (or in one) is matched alike; the alternative, a
    grammar switched on once the closing token is seen, would miss a tag written in pieces."""
    tag = {"type": "tag", "begin": start, "content": {"type": "any_text"}, "end": end}
    block = {"type": "sequence", "elements": [tag, _AFTER_REASONING]}
    if start:
        block = {"type": "optional", "content": block}
    sequence = {"type": "sequence", "elements": [block, answer]}
    return json.dumps({"type": "structural_tag", "format": sequence})


def _reasoning_tags(reasoning) -> tuple[str, str]:
    if (
        not isinstance(reasoning, tuple)
        or len(reasoning) != 2
        or not all(isinstance(tag, str) for tag in reasoning)
    ):
        raise InvalidRequestError("parameters.grammar_reasoning_*: must be two strings")
    if reasoning[0] and not reasoning[1]:
        raise InvalidRequestError(
            "parameters.grammar_reasoning_start: needs grammar_reasoning_end (the closing tag)"
        )
    return reasoning


_SURROGATE_LEAD = 0xED
_SURROGATE_SECOND = range(0xA0, 0xC0)  # after ED: U+D800-U+DFFF


def _utf8_filters(vocab: list[bytes], words: int) -> torch.Tensor:
    """int32 [2, words]: the tokens that may follow text not ending (row 0) and ending (row 1) in
    the byte ED without writing a surrogate."""
    inside, starting = [], []
    for token_id, data in enumerate(vocab):
        if any(a == _SURROGATE_LEAD and b in _SURROGATE_SECOND for a, b in zip(data, data[1:])):
            inside.append(token_id)
        elif data and data[0] in _SURROGATE_SECOND:
            starting.append(token_id)
    anywhere = ~_pack(inside, words)
    return torch.stack([anywhere, anywhere & ~_pack(starting, words)])


def _ends_in(vocab: list[bytes], byte: int) -> list[bool | None]:
    """Per token: whether its bytes end in `byte`, None for a token with no bytes."""
    return [data[-1] == byte if data else None for data in vocab]


def _clean(error: Exception) -> str:
    lines = [line for line in str(error).strip().splitlines() if line.strip()]
    text = lines[-1] if lines else type(error).__name__
    return _CPP_PREFIX.sub("", text).strip() or type(error).__name__


def _pack(token_ids: list[int], words: int) -> torch.Tensor:
    """int32 [words] bitmask with the bits of token_ids set (bit k of word w is token 32 w + k)."""
    flags = np.zeros(words * 32, dtype=np.bool_)
    flags[token_ids] = True
    return torch.from_numpy(np.packbits(flags, bitorder="little").view("<i4").astype(np.int32))


if sys.byteorder == "little":

    def _unpack(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """bool [n, vocab_size] from an int32 [n, words] bitmask; numpy's unpackbits is ~4x faster
        than shifts."""
        flags = np.unpackbits(bits.numpy().view(np.uint8), axis=-1, bitorder="little")
        return torch.from_numpy(flags.view(np.bool_)[:, :vocab_size])
else:  # pragma: no cover - no big-endian machine runs this
    _SHIFTS = torch.arange(32, dtype=torch.int32)

    def _unpack(bits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        return (
            ((bits.unsqueeze(-1) >> _SHIFTS) & 1).bool().reshape(bits.shape[0], -1)[:, :vocab_size]
        )


__all__ = ["CompiledGrammar", "GrammarCompiler", "GrammarState", "fill_masks", "allowed_masks"]
