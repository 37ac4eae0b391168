"""KV blocks found again by the tokens they hold (docs/architecture.md#prefix-caching).

Each full block of a computed sequence is keyed by a hash chain over its tokens and every token
before it, and the LoRA adapter (engine.wire.contract.chain_hashes), so equal keys mean equal KV.
A request whose prompt starts with cached blocks shares them (reference counts) and is sent with
cache_len = their tokens: the shard computes only the rest. A block whose last user is gone stays
cached, and is evicted least recently used only when a new block is needed. Same public face as
router.sched.allocator.BlockAllocator, which serves when prefix caching is off.

A `listener` (router/events/kv_events.py publishes to fleet routers) hears every change of what is
findable: `stored(hashes, parent_hash, token_ids, block_size, adapter)` for a run of blocks made
findable, `removed(hashes)` for evicted ones, `cleared()` when the cache starts over empty.
As vLLM's scheduler does, `stored` goes out when a prompt's blocks are allocated, before the
prefill that fills them: a fleet router then sends the prompt's siblings here while it is still
queued or computing. Those blocks are findable here only once computed; a request freed before
that (cancelled, preempted, failed) takes its announcement back with `removed`, so once the work
is done the events add up to exactly what is findable.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass

from engine.errors import CapacityError
from engine.vision.keys import is_image_key
from engine.wire.contract import RESERVED_BLOCK, chain_hashes
from router.sched.allocator import Allocation


@dataclass
class PrefixStats:
    requests: int = 0  # allocations that could look for a prefix
    hit_requests: int = 0  # of them, those that reused at least one block
    prompt_tokens: int = 0  # tokens those allocations had to prefill
    hit_tokens: int = 0  # of them, tokens found in the cache (not computed)
    evictions: int = 0  # cached blocks given to a new request


class PrefixCache:
    def __init__(self, num_blocks: int, block_size: int):
        if num_blocks < 1 or block_size < 1:
            raise ValueError(
                f"need num_blocks >= 1 and block_size >= 1, got {num_blocks} and {block_size}"
            )
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(RESERVED_BLOCK + 1, num_blocks))  # never held a cached prefix
        self._refs: dict[int, int] = {}  # block -> requests using it
        self._by_hash: dict[int, int] = {}  # chain hash -> the block holding it
        self._hash_of: dict[int, int] = {}  # block -> its chain hash
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, unused: oldest use first
        self._announced: dict[
            int, int
        ] = {}  # block -> the hash told to the listener, not yet findable
        self.stats = PrefixStats()
        self.listener = None

    def listen(self, listener) -> None:
        """Tell `listener` about every change from now on, starting from an empty cache."""
        self.listener = listener
        listener.cleared()

    # --- the allocator's face
    # -----------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        """Blocks a new request can get: never used, or cached and unused (evicted on demand)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return len(self._refs)

    @property
    def num_cached(self) -> int:
        return len(self._hash_of)

    def findable(self) -> set[int]:
        """The chain hashes a prompt can find now (what the listener's events add up to)."""
        return set(self._by_hash)

    @property
    def idle(self) -> bool:
        return not self._refs

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def can_allocate(self, tokens: int) -> bool:
        return tokens >= 0 and self.blocks_for(tokens) <= self.num_free

    def allocate(
        self, tokens: int, token_ids: list[int] | None = None, adapter: str | None = None
    ) -> Allocation:
        """Room for `tokens` tokens; with `token_ids` (the tokens to prefill), the longest cached
        prefix of whole blocks is reused, leaving at least the last token to compute."""
        matched = self._match(token_ids, adapter) if token_ids else []
        needed = self.blocks_for(tokens) - len(matched)
        if needed > self.num_free - sum(block in self._evictable for block in matched):
            raise CapacityError(
                f"KV cache full: {tokens} tokens need {needed} more blocks, {self.num_free} free"
            )
        for block in matched:
            self._use(block)
        blocks = tuple(matched) + tuple(self._take() for _ in range(needed))
        if token_ids is not None:
            self._count(len(token_ids), len(matched))
            self._announce(blocks, token_ids, adapter, len(matched))
        slots = tuple(b * self.block_size + o for b in blocks for o in range(self.block_size))[
            :tokens
        ]
        return Allocation(blocks, slots, len(matched) * self.block_size)

    def fits(
        self, tokens: int, token_ids: list[int] | None, adapter: str | None, copies: int = 1
    ) -> bool:
        """Whether `copies` calls of allocate() would succeed now (counting the blocks they would
        reuse, which all of them share). Counts no lookup."""
        matched = self._match(token_ids, adapter) if token_ids else []
        spare = self.num_free - sum(block in self._evictable for block in matched)
        return copies * (self.blocks_for(tokens) - len(matched)) <= spare

    def grow(self, allocation: Allocation) -> Allocation | None:
        """The allocation with one more block (KV on demand), or None when none is left."""
        if not self.num_free:
            return None
        return Allocation(
            allocation.blocks + (self._take(),), allocation.slots, allocation.cache_len
        )

    def free(self, allocation: Allocation) -> None:
        blocks = set(allocation.blocks)
        if len(blocks) != len(allocation.blocks) or not blocks <= set(self._refs):
            stray = sorted((blocks - set(self._refs)) or set(allocation.blocks))
            raise ValueError(f"blocks {stray} are not allocated (double free?)")
        for block in allocation.blocks:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                del self._refs[block]
                self._withdraw(block)
                if block in self._hash_of:
                    self._evictable[block] = None  # most recently used last
                else:
                    heapq.heappush(self._free, block)

    # --- the prefix cache
    # ---------------------------------------------------------------------------

    def register(self, allocation: Allocation, token_ids: list[int], adapter: str | None) -> None:
        """`token_ids` are in the allocation's blocks now (a prefill or decode completed): its full
        blocks become findable. A hash already held by another block keeps that block."""
        full = min(len(token_ids) // self.block_size, len(allocation.blocks))
        hashes = chain_hashes(token_ids, self.block_size, adapter, full)
        new = []  # indexes of the blocks made findable now, not announced at allocation
        for index, (block, value) in enumerate(zip(allocation.blocks[:full], hashes)):
            if value in self._by_hash or block in self._hash_of:
                if self._announced.get(block) == value:  # computed twice: the other is findable
                    del self._announced[block]
                continue
            self._by_hash[value] = block
            self._hash_of[block] = value
            if self._announced.pop(block, None) != value:
                new.append(index)
        new = [i for i in new if i < self._publishable(token_ids)]
        if self.listener is not None and new:
            self._tell_stored(new, hashes, token_ids, adapter)

    def _publishable(self, token_ids: list[int]) -> int:
        """Blocks before the first image: a consumer keys blocks by token ids, and an image's
        ids (keys, engine/vision/keys.py) are no token ids, so later blocks are not published."""
        plain = next((i for i, t in enumerate(token_ids) if is_image_key(t)), len(token_ids))
        return plain // self.block_size

    def _announce(
        self, blocks: tuple[int, ...], token_ids: list[int], adapter: str | None, matched: int
    ) -> None:
        """Tell the listener now of the full blocks this prefill will compute (not found here,
        nor announced by another request computing them at the same time)."""
        if self.listener is None:
            return
        full = min(len(token_ids) // self.block_size, len(blocks), self._publishable(token_ids))
        hashes = chain_hashes(token_ids, self.block_size, adapter, full)
        pending = set(self._announced.values())
        new = []
        for index in range(matched, full):
            if hashes[index] not in self._by_hash and hashes[index] not in pending:
                self._announced[blocks[index]] = hashes[index]
                new.append(index)
        if new:
            self._tell_stored(new, hashes, token_ids, adapter)

    def _withdraw(self, block: int) -> None:
        """A block announced at allocation is freed before it was computed and made findable."""
        value = self._announced.pop(block, None)
        if value is not None and value not in self._by_hash and self.listener is not None:
            self.listener.removed([value])

    def _tell_stored(
        self, new: list[int], hashes: list[int], token_ids: list[int], adapter: str | None
    ) -> None:
        """One `stored` per run of consecutive new blocks, with the hash before the run (vLLM's
        parent_block_hash) and the run's tokens."""
        size, start = self.block_size, 0
        for end in range(1, len(new) + 1):
            if end < len(new) and new[end] == new[end - 1] + 1:
                continue
            first, last = new[start], new[end - 1]
            self.listener.stored(
                hashes[first : last + 1],
                hashes[first - 1] if first else None,
                list(token_ids[first * size : (last + 1) * size]),
                size,
                adapter,
            )
            start = end

    def _match(self, token_ids: list[int], adapter: str | None) -> list[int]:
        usable = (len(token_ids) - 1) // self.block_size  # the last token is always computed
        matched = []
        for value in chain_hashes(token_ids, self.block_size, adapter, usable):
            if value not in self._by_hash:
                break
            matched.append(self._by_hash[value])
        return matched

    def _use(self, block: int) -> None:
        self._evictable.pop(block, None)
        self._refs[block] = self._refs.get(block, 0) + 1

    def _take(self) -> int:
        """A block for new tokens: a never-cached one first, else the least recently used cached
        one."""
        if self._free:
            block = heapq.heappop(self._free)
        else:
            block, _ = self._evictable.popitem(last=False)
            value = self._hash_of.pop(block)
            del self._by_hash[value]
            self.stats.evictions += 1
            if self.listener is not None:
                self.listener.removed([value])
        self._refs[block] = 1
        return block

    def _count(self, tokens: int, matched_blocks: int) -> None:
        self.stats.requests += 1
        self.stats.prompt_tokens += tokens
        self.stats.hit_tokens += matched_blocks * self.block_size
        self.stats.hit_requests += matched_blocks > 0
