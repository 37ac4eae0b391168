"""Plain dataclasses mirroring the generate.v3 messages (docs/architecture.md#wire-protocol).

The shard works on these; the gRPC server only translates them to and from protobuf.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum


class FinishReason(IntEnum):
    LENGTH = 0
    EOS_TOKEN = 1
    STOP_SEQUENCE = 2


class GrammarType(IntEnum):
    NONE = 0
    JSON = 1
    REGEX = 2


@dataclass
class NextTokenChooserParameters:
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    typical_p: float = 1.0
    do_sample: bool = False
    seed: int | None = (
        None  # None: unset (a direct caller's); on the wire every value is a seed, 0 too
    )
    repetition_penalty: float = 1.0
    watermark: bool = False
    frequency_penalty: float = 0.0
    grammar: str = ""
    grammar_type: GrammarType = GrammarType.NONE
    # bucketserve extensions of the protocol (proto field numbers >= 1000)
    presence_penalty: float = 0.0
    logit_bias: dict[int, float] = field(
        default_factory=dict
    )  # token id -> bias added to its logit
    # a reasoning block before the answer the grammar constrains (engine/grammar.py after_reasoning)
    grammar_reasoning_start: str = ""
    grammar_reasoning_end: str = ""


@dataclass
class StoppingCriteriaParameters:
    max_new_tokens: int = 20
    stop_sequences: list[str] = field(default_factory=list)
    ignore_eos_token: bool = False
    min_new_tokens: int = 0  # bucketserve extension: no EOS before this many tokens


def kv_tokens(prompt_len: int, max_new_tokens: int) -> int:
    """The KV-cache tokens a request can fill: its prompt and every generated token but the last,
    which ends the sequence without being fed back (the router's block budget and the shard's
    allocation both count this)."""
    return prompt_len + max_new_tokens - 1


@dataclass(frozen=True)
class ImageInput:
    """An image of a prompt, as the v3 protocol's InputChunk.image carries it."""

    data: bytes
    mimetype: str
    width: int = 0  # what the router read (0: not read yet)
    height: int = 0


@dataclass
class Request:
    id: int
    inputs: str
    truncate: int = 0  # 0: keep the whole prompt; else keep its last `truncate` tokens
    parameters: NextTokenChooserParameters = field(default_factory=NextTokenChooserParameters)
    stopping_parameters: StoppingCriteriaParameters = field(
        default_factory=StoppingCriteriaParameters
    )
    prefill_logprobs: bool = False
    top_n_tokens: int = 0
    blocks: list[int] = field(
        default_factory=list
    )  # router-assigned KV blocks; empty: shard allocates
    slots: list[int] = field(default_factory=list)
    adapter_id: str | None = None
    cache_len: int = 0
    add_special_tokens: bool = True
    chunk_len: int | None = None
    prefill_source: int | None = (
        None  # a request of the same Prefill whose prompt KV this one copies
    )
    # The prompt as text and images in order (v3 input_chunks), where it has images; None: text only
    chunks: list[str | ImageInput] | None = None


@dataclass
class Batch:
    id: int
    requests: list[Request]
    size: int = 0
    max_tokens: int = 0
    max_blocks: int = 0


@dataclass
class CachedBatch:
    id: int
    request_ids: list[int]
    size: int
    max_tokens: int
    current_tokens: int


@dataclass
class Tokens:
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    texts: list[str] = field(default_factory=list)
    is_special: list[bool] = field(default_factory=list)


@dataclass
class GeneratedText:
    text: str
    generated_tokens: int
    finish_reason: FinishReason
    seed: int | None = None


@dataclass
class Generation:
    request_id: int
    prefill_tokens: Tokens | None
    tokens: Tokens
    generated_text: GeneratedText | None = None
    top_tokens: list[Tokens] = field(default_factory=list)


@dataclass
class InfoResponse:
    requires_padding: bool
    dtype: str
    device_type: str
    window_size: int | None
    speculate: int
    support_chunking: bool
    use_prefix_caching: bool
    attention_impl: str
    block_size: int
    pipeline_stages: int = 1  # the router keeps this many batches in flight


@dataclass
class WarmupResult:
    max_supported_total_tokens: int | None  # None: a shard that does not report its KV capacity
    max_input_tokens: int
    max_total_tokens: int


@dataclass
class StepTimings:
    """Where the time of a Prefill or Decode went (the v3 responses carry these)."""

    forward_ns: int  # device forwards
    decode_ns: int  # everything else: token choice, detokenization, stopping
    total_ns: int
    concat_ns: int | None = None  # joining cached batches, when there were several


@dataclass
class EmbedInput:
    """One input of an Embed call (a bucketserve extension of generate.v3, proto/CONTRACT.md): its
    token ids, already tokenized by the router, and `dimensions` to keep (0: all of them)."""

    id: int
    token_ids: list[int]
    dimensions: int = 0


@dataclass
class Embedding:
    """An input's pooled final hidden state, L2-normalized (engine/serving/embed.py)."""

    request_id: int
    values: list[float]
