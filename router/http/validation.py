"""TGI's request schema and checks: what a `/generate` body may say, turned into a protocol
`Request`.

The OpenAI endpoints build the same `Parameters` from their own fields, so every request, whichever
API it came through, passes the same checks with TGI's messages.
"""

from __future__ import annotations

import json
import math
import secrets
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from engine.batch import (
    GrammarType,
    NextTokenChooserParameters,
    Request,
    StoppingCriteriaParameters,
)
from engine.wire.contract import MAX_LOGIT_BIAS
from router.images.decode import ImageError
from router.images.prompt import ImagePolicy, image_prompt
from router.sched.admission import check_lengths

MAX_STOP_SEQUENCES = 4
MAX_TOP_N_TOKENS = 5
MAX_STOP_CHARS = 512  # per stop sequence: each is matched against the text after every token
U32_MAX = 2**32 - 1
FLOAT32_MAX = 3.4028234663852886e38


class ValidationError(Exception):
    """The request is wrong: HTTP 422 with TGI's `validation` error type."""


class Grammar(BaseModel):
    type: Literal["json", "json_object", "regex"]
    value: Any


class AnswerGrammar(Grammar):
    """A grammar for the answer a reasoning model writes after its reasoning block: the chat
    APIs build it (router/http/reasoning.py); no request body spells it."""

    reasoning_start: str  # the block's opening tag; "": the reply starts inside the block
    reasoning_end: str


def reasoning_tags(grammar: Grammar | None) -> tuple[str, str]:
    if isinstance(grammar, AnswerGrammar):
        return grammar.reasoning_start, grammar.reasoning_end
    return "", ""


class Parameters(BaseModel):
    model_config = ConfigDict(extra="ignore")
    max_new_tokens: int | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    typical_p: float | None = None
    do_sample: bool = False
    seed: int | None = None
    repetition_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: list[str] = []
    truncate: int | None = None
    return_full_text: bool | None = False
    details: bool = False
    decoder_input_details: bool = False
    top_n_tokens: int | None = None
    watermark: bool = False
    best_of: int | None = None
    grammar: Grammar | None = None
    adapter_id: str | None = None
    # vLLM's and OpenAI's extras (bucketserve protocol extensions, listed in proto/CONTRACT.md)
    presence_penalty: float | None = None
    logit_bias: dict[int, float] | None = None
    min_new_tokens: int | None = None
    ignore_eos: bool = False


class GenerateRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    inputs: str
    parameters: Parameters = Parameters()
    stream: bool = False


@dataclass(frozen=True)
class Limits:
    """What the shards were warmed for, and what the router serves (from /info)."""

    max_input_tokens: int
    max_total_tokens: int
    adapters: tuple[str, ...] = ()
    token_chars: int | None = None  # the longest token's length in characters (None: unknown)


def check(condition: bool, message: str) -> None:
    if not condition:
        raise ValidationError(message)


def check_text(name: str, text: str) -> None:
    """Text must be valid Unicode (JSON can spell an unpaired surrogate, `\ud800`; no wire carries
    it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValidationError(
            f"`{name}` is not valid Unicode text (it has an unpaired surrogate)"
        ) from None


def check_wire_ranges(p: Parameters) -> None:
    """What the protocol's types hold: uint32 counts and finite float32 numbers."""
    for name in ("max_new_tokens", "top_k", "truncate", "top_n_tokens"):
        value = getattr(p, name)
        check(value is None or value <= U32_MAX, f"`{name}` must be <= {U32_MAX}. Given: {value}")
    for name in ("temperature", "top_p", "typical_p", "repetition_penalty", "frequency_penalty"):
        value = getattr(p, name)
        check(
            value is None or (math.isfinite(value) and abs(value) <= FLOAT32_MAX),
            f"`{name}` must be a finite number. Given: {value}",
        )


def check_stop(stop: list[str]) -> None:
    check(
        len(stop) <= MAX_STOP_SEQUENCES,
        f"`stop` supports up to {MAX_STOP_SEQUENCES} stop sequences. Given: {len(stop)}",
    )
    for text in stop:
        check_text("stop", text)
        check(
            0 < len(text) <= MAX_STOP_CHARS,
            f"each `stop` sequence must have 1 to {MAX_STOP_CHARS} characters. Given: {len(text)}",
        )


def check_sampling(p: Parameters) -> None:
    check_wire_ranges(p)
    check(
        p.best_of is None or p.best_of > 0, f"`best_of` must be > 0. Given: {p.best_of}"
    )  # > 1: tgi_api.py
    check(p.temperature is None or p.temperature > 0, "`temperature` must be strictly positive")
    check(
        p.repetition_penalty is None or p.repetition_penalty > 0,
        "`repetition_penalty` must be strictly positive",
    )
    check(
        p.frequency_penalty is None or -2 <= p.frequency_penalty <= 2,
        "`frequency_penalty` must be >= -2.0 and <= 2.0",
    )
    check(p.top_p is None or 0 < p.top_p <= 1, "`top_p` must be > 0.0 and <= 1.0")
    check(p.typical_p is None or 0 < p.typical_p <= 1, "`typical_p` must be > 0.0 and <= 1.0")
    check(p.top_k is None or p.top_k > 0, "`top_k` must be strictly positive")
    check(p.seed is None or 0 <= p.seed < 2**64, "`seed` must be in [0, 2**64)")
    check_stop(p.stop)
    check(
        p.presence_penalty is None or -2 <= p.presence_penalty <= 2,
        "`presence_penalty` must be >= -2.0 and <= 2.0",
    )
    check(
        all(-100 <= v <= 100 for v in (p.logit_bias or {}).values()),
        "`logit_bias` values must be >= -100 and <= 100",
    )
    entries = len(p.logit_bias or {})
    check(
        entries <= MAX_LOGIT_BIAS,
        f"`logit_bias` may hold at most {MAX_LOGIT_BIAS} entries. Given: {entries}",
    )
    check(p.min_new_tokens is None or p.min_new_tokens >= 0, "`min_tokens` must be >= 0")
    top_n = p.top_n_tokens or 0
    check(
        0 <= top_n <= MAX_TOP_N_TOKENS,
        f"`top_n_tokens` must be >= 0 and <= {MAX_TOP_N_TOKENS}. Given: {top_n}",
    )


def check_adapter(adapter_id: str | None, limits: Limits) -> None:
    if not adapter_id:  # none, or "" as TGI's clients send: the base model
        return
    loaded = ", ".join(limits.adapters) or "none"
    check(
        adapter_id in limits.adapters,
        f"unknown adapter_id {adapter_id!r} (loaded adapters: {loaded})",
    )


def grammar_fields(grammar: Grammar | None) -> tuple[str, GrammarType]:
    """TGI's `grammar` parameter as the protocol's (text, type); a JSON schema goes as its JSON
    text."""
    if grammar is None:
        return "", GrammarType.NONE
    if grammar.type == "regex":
        check(
            isinstance(grammar.value, str) and grammar.value != "",
            "`grammar.value` must be a non-empty regex",
        )
        return grammar.value, GrammarType.REGEX
    if grammar.type == "json_object":  # any JSON object
        return json.dumps({"type": "object"}), GrammarType.JSON
    value = grammar.value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise ValidationError(f"`grammar.value` is not valid JSON: {error}") from None
    check(isinstance(value, dict), "`grammar.value` must be a JSON schema object")
    return json.dumps(value), GrammarType.JSON


def longest_token_chars(tokenizer) -> int | None:
    """The most characters one token stands for: a vocabulary entry is at least as long as the text
    it decodes to (byte-level entries have one character per byte), so a prompt of more than
    max_input_tokens times this many characters has more than max_input_tokens tokens."""
    try:
        return max(len(token) for token in tokenizer.get_vocab())
    except (AttributeError, TypeError, ValueError):
        return None


def prompt_ids(
    tokenizer, limits: Limits, inputs: str, truncate: int | None, add_special_tokens: bool
) -> list[int]:
    """The prompt's token ids as the shard computes them (truncation keeps the last `truncate`):
    the one tokenization a request gets in the router. Their count is checked, with
    max_new_tokens, by `new_tokens`."""
    max_input = limits.max_input_tokens
    check(inputs != "", "`inputs` cannot be empty")
    check_text("inputs", inputs)
    check(
        truncate is None or 0 < truncate <= max_input,
        f"`truncate` must be strictly positive and less than {max_input}. Given: {truncate}",
    )
    if (
        truncate is None and limits.token_chars
    ):  # cheap: refuse a surely too long prompt before tokenizing it
        check(
            len(inputs) <= max_input * limits.token_chars,
            f"`inputs` must have at most {max_input} tokens. Given: {len(inputs)} characters, "
            "more tokens than that",
        )
    ids = tokenizer(inputs, add_special_tokens=add_special_tokens)["input_ids"]
    if truncate is not None:
        ids = ids[-truncate:]
    return ids


def new_tokens(limits: Limits, p: Parameters, length: int) -> int:
    """The tokens to generate (by default, up to max_total_tokens), checked with the prompt's
    `length` by the router's one length check (router/sched/admission.py)."""
    max_total = limits.max_total_tokens
    new = p.max_new_tokens if p.max_new_tokens is not None else max_total - length
    try:
        check_lengths(length, new, limits.max_input_tokens, max_total)
    except ValueError as error:
        raise ValidationError(str(error)) from None
    return new


def build_request(
    request_id: int,
    tokenizer,
    limits: Limits,
    inputs: str,
    p: Parameters,
    add_special_tokens: bool = True,
    grammar_check=None,
    images: ImagePolicy | None = None,
) -> tuple[Request, list[int]]:
    """The protocol request for `inputs` with TGI parameters `p`, and its prompt's token ids.
    `grammar_check(text, type, reasoning)` compiles a grammar as the shard will
    (router/http/grammar_check.py); `images`: the model's images, where the prompt may hold some
    (router/images/)."""
    check_sampling(p)
    check_adapter(p.adapter_id, limits)
    grammar, grammar_type = grammar_fields(p.grammar)
    check_text("grammar", grammar)
    if grammar_check is not None:
        grammar_check(grammar, grammar_type, reasoning_tags(p.grammar))
    try:
        pictured = image_prompt(inputs, images) if images is not None else None
    except ImageError as error:
        raise ValidationError(str(error)) from None
    counted = pictured.counted if pictured else inputs
    ids = prompt_ids(
        tokenizer, limits, counted, None if pictured else p.truncate, add_special_tokens
    )
    check(
        pictured is None or p.truncate is None or len(ids) <= p.truncate,
        "`truncate` would cut the prompt's images: send a shorter prompt instead",
    )
    new = new_tokens(limits, p, len(ids))
    vocab = len(tokenizer)
    bad = sorted(t for t in (p.logit_bias or {}) if not 0 <= t < vocab)
    check(not bad, f"`logit_bias` token ids must be in [0, {vocab}). Given: {bad[:5]}")
    check((p.min_new_tokens or 0) <= new, f"`min_tokens` must be <= the tokens to generate ({new})")
    request = Request(
        request_id,
        pictured.wire if pictured else inputs,
        truncate=p.truncate or 0,
        parameters=chooser_parameters(p, grammar, grammar_type),
        stopping_parameters=StoppingCriteriaParameters(
            new, list(p.stop), p.ignore_eos, p.min_new_tokens or 0
        ),
        prefill_logprobs=p.decoder_input_details,
        top_n_tokens=p.top_n_tokens or 0,
        adapter_id=p.adapter_id or None,
        add_special_tokens=add_special_tokens,
        chunks=pictured.chunks if pictured else None,
    )
    return request, ids


def chooser_parameters(
    p: Parameters, grammar: str, grammar_type: GrammarType
) -> NextTokenChooserParameters:
    """The protocol's sampling fields for TGI parameters `p`, their defaults where `p` leaves them
    out; a request without a seed gets a random one."""
    return NextTokenChooserParameters(
        temperature=p.temperature or 1.0,
        top_k=p.top_k or 0,
        top_p=p.top_p or 1.0,
        typical_p=p.typical_p or 1.0,
        do_sample=p.do_sample,
        seed=p.seed if p.seed is not None else secrets.randbits(64),
        repetition_penalty=p.repetition_penalty or 1.0,
        watermark=p.watermark,
        frequency_penalty=p.frequency_penalty or 0.0,
        grammar=grammar,
        grammar_type=grammar_type,
        presence_penalty=p.presence_penalty or 0.0,
        logit_bias=dict(p.logit_bias or {}),
        grammar_reasoning_start=reasoning_tags(p.grammar)[0],
        grammar_reasoning_end=reasoning_tags(p.grammar)[1],
    )
