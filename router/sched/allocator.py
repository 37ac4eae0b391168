"""KV blocks and slots that the router assigns to each request
(docs/architecture.md#kv-blocks-and-slots).

A v3 router owns the shards' KV cache layout: every request carries its `blocks` and its `slots`
(slot = block * block_size + offset), one slot per token. Block 0 is never handed out: the shards
send padding there, and the router's health probe prefills on it.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

from engine.errors import CapacityError
from engine.wire.contract import RESERVED_BLOCK


@dataclass(frozen=True)
class Allocation:
    blocks: tuple[int, ...]
    slots: tuple[int, ...]
    # tokens of the first blocks already computed (a prefix-cache hit: router/sched/prefix_cache.py)
    cache_len: int = 0


class BlockAllocator:
    """Lowest free block ids first, so a lightly loaded server keeps touching the same memory."""

    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(RESERVED_BLOCK + 1, num_blocks))  # sorted, hence already a heap
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return len(self._used)

    @property
    def idle(self) -> bool:
        return not self._used

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_allocate(self, tokens: int) -> bool:
        return tokens >= 0 and self.blocks_for(tokens) <= len(self._free)

    def fits(self, tokens: int, token_ids=None, adapter=None, copies: int = 1) -> bool:
        """Whether `copies` allocations of `tokens` tokens each would succeed now."""
        return tokens >= 0 and copies * self.blocks_for(tokens) <= len(self._free)

    def register(self, allocation: Allocation, token_ids, adapter) -> None:
        """Nothing is cached without prefix caching (router/sched/prefix_cache.py)."""

    def allocate(self, tokens: int, token_ids=None, adapter=None) -> Allocation:
        """Room for `tokens` tokens: whole blocks, and the first `tokens` slots of them."""
        if tokens < 0:
            raise ValueError(f"cannot allocate {tokens} tokens")
        needed = self.blocks_for(tokens)
        if needed > len(self._free):
            raise CapacityError(
                f"KV cache full: {tokens} tokens need {needed} blocks, {len(self._free)} free"
            )
        blocks = tuple(heapq.heappop(self._free) for _ in range(needed))
        self._used.update(blocks)
        size = self.block_size
        slots = tuple(block * size + offset for block in blocks for offset in range(size))[:tokens]
        return Allocation(blocks, slots)

    def grow(self, allocation: Allocation) -> Allocation | None:
        """The allocation with one more block (KV on demand), or None when none is free."""
        if not self._free:
            return None
        block = heapq.heappop(self._free)
        self._used.add(block)
        return Allocation(allocation.blocks + (block,), allocation.slots, allocation.cache_len)

    def free(self, allocation: Allocation) -> None:
        """Return the blocks; all or nothing, so a bad free leaves the books as they were."""
        blocks = set(allocation.blocks)
        if len(blocks) != len(allocation.blocks) or not blocks <= self._used:
            stray = sorted((blocks - self._used) or set(allocation.blocks))
            raise ValueError(f"blocks {stray} are not allocated (double free?)")
        self._used -= blocks
        for block in blocks:
            heapq.heappush(self._free, block)
