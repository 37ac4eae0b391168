"""Reasoning output: the thinking a model writes between `<think>` and `</think>`, split from its
answer (`--reasoning-parser`; OpenAI-compatible servers return it as `reasoning_content`).

Two parsers, for the families that think in these tags:

- `qwen3`: the reasoning is the block the reply opens with; a reply that does not open with
  `<think>` has none (Qwen3, QwQ, SmolLM3: their templates write both tags).
- `deepseek_r1`: the reply starts inside the block, whether or not it writes `<think>`: all the
  text before `</think>` is reasoning (DeepSeek-R1's first template never showed the opening tag).

The rendered prompt says where the reply starts (`Parser.first_phase`): a template that opened
the block (DeepSeek-R1's later templates end the prompt with `<think>`) starts it in the
reasoning; one that closed it (Qwen3's `enable_thinking: false` writes an empty block) in the
answer. Whitespace beside the tags is dropped, as the templates drop it when they render past
turns: `<think>\\nplan\\n</think>\\n\\nanswer` splits into `plan` and `answer`.

`split` cuts a finished text; `ReasoningStream` cuts the same text given in pieces (tokens of a
stream), holding back what may be the start of a tag or whitespace before `</think>`, so that
its pieces always add up to what `split` gives, however the text was cut.

A grammar (tools, `json_schema`) constrains the answer only: `Parser.grammar_block` names the
block the shard's grammar lets through first (engine/grammar.py, an xgrammar structural tag).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

THINK_START, THINK_END = "<think>", "</think>"
DEEPSEEK_MARK = "<｜Assistant｜>"  # DeepSeek's templates (full-width bars)
CHOICES = ("auto", "none", "qwen3", "deepseek_r1")


class Phase(Enum):
    LEADING = "leading"  # nothing but whitespace yet: the reply may open the block
    REASONING = "reasoning"
    ANSWER = "answer"


@dataclass(frozen=True)
class Split:
    reasoning: str | None  # None: the reply had no reasoning block
    content: str


@dataclass(frozen=True)
class Delta:
    reasoning: str = ""
    content: str = ""


@dataclass(frozen=True)
class Parser:
    name: str
    implicit_start: bool  # the reply starts in the block even without the opening tag
    start: str = THINK_START
    end: str = THINK_END

    def first_phase(self, prompt: str) -> Phase:
        """Where a reply to `prompt` starts: after a block the template closed (thinking off), in
        one it opened, or where the model decides."""
        tail = prompt.rstrip()
        if tail.endswith(self.end):
            return Phase.ANSWER
        if tail.endswith(self.start):
            return Phase.REASONING
        return Phase.LEADING

    def grammar_block(self, phase: Phase) -> tuple[str, str] | None:
        """(opening tag, closing tag) of the block a grammar lets through before the answer; an
        empty opening tag: the block is not optional and its text starts at once. None: no block."""
        if phase is Phase.ANSWER:
            return None
        if phase is Phase.LEADING and not self.implicit_start:
            return self.start, self.end
        return "", self.end  # a leading `<think>` of a deepseek_r1 reply is free text in it

    def split(self, text: str, phase: Phase) -> Split:
        """The reasoning and the answer of a finished reply starting in `phase`."""
        if phase is Phase.LEADING:
            opened = text.lstrip()
            if opened.startswith(self.start):
                phase, text = Phase.REASONING, opened[len(self.start) :]
            elif self.implicit_start:
                phase = Phase.REASONING
        if phase is not Phase.REASONING:
            return Split(None, text)
        reasoning, _, answer = text.partition(self.end)
        return Split(reasoning.strip(), answer.lstrip())


PARSERS = {"qwen3": Parser("qwen3", False), "deepseek_r1": Parser("deepseek_r1", True)}


@dataclass(frozen=True)
class ReplyReasoning:
    """One reply's reasoning: the parser, and the phase the reply starts in (from its prompt)."""

    parser: Parser
    phase: Phase

    @classmethod
    def for_prompt(cls, parser: Parser | None, prompt: str) -> ReplyReasoning | None:
        return None if parser is None else cls(parser, parser.first_phase(prompt))

    def split(self, text: str) -> Split:
        return self.parser.split(text, self.phase)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.parser, self.phase)

    @property
    def grammar_block(self) -> tuple[str, str] | None:
        return self.parser.grammar_block(self.phase)

    def tokens(self, texts: list[str]) -> int:
        """How many of a reply's tokens (their texts) wrote its reasoning."""
        stream = self.stream()
        for text in texts:
            stream.feed(text)
        stream.finish()
        return stream.tokens


def parser_for(choice: str, chat_template: str | None) -> Parser | None:
    """The parser `--reasoning-parser` names. `auto`: from the chat template where it leaves no
    doubt: one that writes `<think>` is qwen3's kind (DeepSeek's own templates, R1's kind); one
    that only strips `</think>` from past turns (DeepSeek-R1's first) deepseek_r1; any other
    template gets none, so a model that does not think in tags keeps its text whole."""
    if choice == "none":
        return None
    if choice != "auto":
        return PARSERS[choice]
    template = chat_template if isinstance(chat_template, str) else ""
    if THINK_END not in template:
        return None
    if THINK_START not in template or DEEPSEEK_MARK in template:
        return PARSERS["deepseek_r1"]
    return PARSERS["qwen3"]


def partial_tag(text: str, tag: str) -> int:
    """The length of the longest end of `text` that begins `tag` (0: none)."""
    for size in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-size:]):
            return size
    return 0


class ReasoningStream:
    """`split` over a text given in pieces: each `feed` returns what is certain so far, `finish`
    the rest. `tokens` counts the pieces fed until the block closed (OpenAI's reasoning_tokens,
    where a piece is a token)."""

    def __init__(self, parser: Parser, phase: Phase):
        self.parser, self.phase = parser, phase
        self.held = ""  # a tag's beginning, or whitespace not yet known to be inside the text
        self.strip = phase is Phase.REASONING  # drop the whitespace that follows a tag
        self.opened = phase is Phase.REASONING
        self.pieces = 0

    @property
    def tokens(self) -> int:
        """The pieces that wrote the reasoning, its tags included (0: there was none)."""
        return self.pieces if self.opened else 0

    def feed(self, text: str, pieces: int = 1) -> Delta:
        """`pieces`: how many tokens `text` is (0: the rest of a text, not a token)."""
        if self.phase is not Phase.ANSWER:
            self.pieces += pieces
        reasoning, content = [], []
        text, self.held = self.held + text, ""
        while text and not self.held:
            if self.phase is Phase.LEADING:
                text = self._lead(text)
            elif self.phase is Phase.REASONING:
                text = self._reason(text, reasoning)
            else:
                if self.strip:
                    text = text.lstrip()
                    self.strip = not text
                content.append(text)
                text = ""
        return Delta("".join(reasoning), "".join(content))

    def _lead(self, text: str) -> str:
        opened = text.lstrip()
        start = self.parser.start
        if opened.startswith(start):
            self._open()
            return opened[len(start) :]
        if start.startswith(opened):  # whitespace, or the opening tag cut short: wait
            self.held = text
            return ""
        if self.parser.implicit_start:
            self._open()
        else:
            self.phase = Phase.ANSWER
        return text

    def _open(self) -> None:
        self.phase, self.strip, self.opened = Phase.REASONING, True, True

    def _reason(self, text: str, out: list[str]) -> str:
        if self.strip:
            text = text.lstrip()
            self.strip = not text
            if not text:
                return ""
        before, closed, after = text.partition(self.parser.end)
        if closed:
            out.append(before.rstrip())
            self.phase, self.strip = Phase.ANSWER, True
            return after
        body = text[: len(text) - partial_tag(text, self.parser.end)]
        out.append(body.rstrip())
        self.held = text[len(body.rstrip()) :]
        return ""

    def finish(self) -> Delta:
        """What was held back, once the text has ended."""
        held, self.held = self.held, ""
        if self.phase is Phase.LEADING:
            if self.parser.implicit_start:
                self.opened = True
                return Delta(reasoning=held.strip())
            return Delta(content=held)
        if self.phase is Phase.REASONING:
            return Delta(reasoning=held.rstrip())
        return Delta()
