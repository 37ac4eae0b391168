"""Paged KV cache: per layer one K and one V tensor of [num_blocks * block_size, kv_heads,
head_dim].

A token's slot is block * block_size + offset. Block 0 is reserved: padding tokens write there and
padding blocks read from it, so real blocks are never touched by padding.
"""

from __future__ import annotations

import heapq

import torch

from engine.errors import CapacityError
from engine.wire.contract import RESERVED_BLOCK, chain_hashes


class ShardBlockPool:
    """The shard's own KV blocks, lowest free id first, for requests that arrive without
    router-assigned blocks: the warmup batches (TGI's router sends its own without blocks too) and
    any request whose `blocks` are empty. A v3 router assigns blocks itself with its BlockAllocator
    (router/sched/allocator.py)."""

    def __init__(self, num_blocks: int):
        self._free = list(range(RESERVED_BLOCK + 1, num_blocks))
        heapq.heapify(self._free)
        self.num_blocks = num_blocks

    @property
    def num_free(self) -> int:
        return len(self._free)

    def can_allocate(self, count: int) -> bool:
        return count <= len(self._free)

    def allocate(self, count: int) -> list[int]:
        if not self.can_allocate(count):
            raise CapacityError(
                f"KV cache full: {count} blocks needed, {len(self._free)} free of "
                f"{self.num_blocks - 1}"
            )
        return [heapq.heappop(self._free) for _ in range(count)]

    def free(self, blocks: list[int]) -> None:
        for block in blocks:
            heapq.heappush(self._free, block)


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


def slots_for(blocks: list[int], start: int, end: int, block_size: int) -> list[int]:
    """Cache slots of the token positions [start, end) of a sequence stored in `blocks`."""
    return [blocks[pos // block_size] * block_size + pos % block_size for pos in range(start, end)]


class KVCache:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        kv_heads: int,
        head_dim: int,
        dtype,
        device,
        zeros=None,
    ):
        """`zeros(shape, dtype)`: the device adapter's allocator of zero-filled tensors (default
        torch.zeros)."""
        self.num_blocks, self.block_size = num_blocks, block_size
        self.copied_prompts = 0  # copy_slots calls: prompts shared instead of computed
        shape = (num_blocks * block_size, kv_heads, head_dim)
        zeros = zeros or (lambda size, kind: torch.zeros(size, dtype=kind, device=device))
        self.layers = [(zeros(shape, dtype), zeros(shape, dtype)) for _ in range(num_layers)]
        self.extras: list[torch.Tensor] = []  # other per-slot tensors copy_slots carries along

    def copy_slots(self, source: torch.Tensor, target: torch.Tensor) -> None:
        """Every layer's K and V at slots `source` copied to slots `target` (equal-length index
        tensors on the cache's device). Callers pad both to one fixed length with RESERVED_BLOCK's
        slot 0, so graph devices see a single shape and padding copies the reserved slot onto
        itself."""
        for keys, values in self.layers:
            keys.index_copy_(0, target, keys.index_select(0, source))
            values.index_copy_(0, target, values.index_select(0, source))
        for extra in self.extras:  # EAGLE-3's aux hidden states (engine/speculative/eagle3.py)
            extra.index_copy_(0, target, extra.index_select(0, source))
        self.copied_prompts += 1

    @staticmethod
    def bytes_per_block(
        num_layers: int, block_size: int, kv_heads: int, head_dim: int, dtype
    ) -> int:
        return (
            2
            * num_layers
            * block_size
            * kv_heads
            * head_dim
            * torch.empty((), dtype=dtype).element_size()
        )

    @property
    def capacity_tokens(self) -> int:
        """Tokens the cache can hold for requests (block 0 excluded)."""
        return (self.num_blocks - 1) * self.block_size


class BlockContents:
    """block -> hash chain of the tokens it holds (engine.wire.contract.chain_hashes), for blocks
    filled by a completed forward: what a prefix cache may reuse. The shard keeps one for its
    cache (engine/serving/prefix.py checks a router's cache_len with it), a draft model one for
    its own."""

    def __init__(self, block_size: int):
        self.block_size = block_size
        self._hashes: dict[int, int] = {}

    def forget(self, blocks) -> None:
        """Blocks about to be written with new tokens hold nothing reusable any more."""
        for block in blocks:
            self._hashes.pop(block, None)

    def record(
        self, blocks: list[int], token_ids: list[int], adapter: str | None, filled: int
    ) -> None:
        """After a forward: the sequence's first `filled` tokens are in its blocks."""
        full = filled // self.block_size
        for block, value in zip(
            blocks[:full], chain_hashes(token_ids, self.block_size, adapter, full)
        ):
            self._hashes[block] = value

    def held(self, blocks: list[int], token_ids: list[int], adapter: str | None, count: int) -> int:
        """How many of the first `count` blocks, from the first on, hold those tokens."""
        expected = chain_hashes(token_ids, self.block_size, adapter, count)
        for position, (block, value) in enumerate(zip(blocks, expected)):
            if self._hashes.get(block) != value:
                return position
        return min(count, len(blocks))
