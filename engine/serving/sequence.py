"""The shard's state for one request between RPCs."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.batch import FinishReason, Request
from engine.kv_cache import blocks_needed, slots_for


@dataclass
class Sequence:
    request: Request
    token_ids: list[int]  # prompt followed by every generated token
    prompt_len: int
    blocks: list[int]
    block_size: int
    owns_blocks: bool  # allocated by the shard (freed by it) or by the router
    router_slots: list[int] = field(default_factory=list)
    sampling: object = None  # SamplingState: parameters, seed, generator
    grammar: object = None  # GrammarState when the request is constrained
    output_text: str = ""  # generated text so far, for stop sequences
    prefix_offset: int = 0  # incremental detokenization window
    read_offset: int = 0
    finish_reason: FinishReason | None = None
    cache_len: int = 0  # prompt tokens whose KV the router said was cached (not computed)
    computed: int = 0  # tokens whose KV is in the cache
    prefill_end: int = 0  # tokens its prefill computes (prompt, and a resumed request's tokens)
    speculation: object = None  # the proposer's state for this sequence (engine/speculative/)
    image_features: object = None  # a VLM prompt's [image tokens, hidden] (engine/vision/)
    image_spans: list = field(default_factory=list)  # each image's [first, last) positions
    keyed_prompt: list | None = None  # its prompt's ids, image tokens keyed (engine/vision/keys.py)
    rope_positions: object = None  # M-RoPE: the prompt's [3, tokens] positions (vision/grids.py)
    rope_delta: int = 0  # M-RoPE: a position after the prompt turns at position + delta

    @property
    def prefilling(self) -> bool:
        """Chunked prefill: part of the prompt is still to be computed (no token sampled yet)."""
        return self.computed < self.prefill_end

    @property
    def id(self) -> int:
        return self.request.id

    @property
    def generated(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def generated_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len :]

    @property
    def max_new_tokens(self) -> int:
        return self.request.stopping_parameters.max_new_tokens

    def slots(self, start: int, end: int) -> list[int]:
        """Cache slots of positions [start, end): the router's when it sent them, else from
        blocks."""
        if len(self.router_slots) >= end:
            return self.router_slots[start:end]
        return slots_for(self.blocks, start, end, self.block_size)

    def blocks_through(self, position: int) -> list[int]:
        """The blocks holding positions 0..position."""
        return self.blocks[: blocks_needed(position + 1, self.block_size)]
