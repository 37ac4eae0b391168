"""Which queued requests the scheduler admits into its next Prefill, and the batch it sends.

Requests leave the head of the FIFO queue while the batch has rows, the prefill budget has room and
their KV blocks fit (router/sched/kv_blocks.py); the head waits, never skipped. When the shards
chunk prompts (Info.support_chunking), a prompt longer than the budget left is admitted with
chunk_len = that room: the shard computes the rest in the following steps, next to the decodes.
The members of an `n`/`best_of` group (router/sched/fanout.py) are admitted together, sharing one
prefill, when their prompt fits the budget; a longer one splits them into lone requests.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, replace

from engine.batch import Batch
from engine.config import ServingLimits
from router.sched import fanout, kv_blocks
from router.sched.allocator import BlockAllocator
from router.sched.scheduler_stats import SchedulerStats
from router.sched.streams import Entry


@dataclass(frozen=True)
class Room:
    """What the next Prefill may hold, as the scheduler sees it at this step."""

    limits: ServingLimits
    running: int  # rows the running batch already takes
    chunking: bool  # the shards compute a long prompt in chunks (Info.support_chunking)
    longest_resume: int | None  # the longest prefill the shards resume (None: they resume nothing)


def next_batch(
    queue: deque[Entry], allocator: BlockAllocator, room: Room, stats: SchedulerStats
) -> list[Entry]:
    """The entries admitted now, taken off the head of `queue`, each holding its blocks."""
    limits, taken, tokens = room.limits, [], 0
    while queue:
        group = fanout.leading_group(queue)
        if len(group) > 1 and fanout.prefill_tokens(group) > limits.max_prefill_tokens:
            fanout.split(group)
            group = group[:1]
        budget = limits.max_prefill_tokens - tokens
        if room.running + len(taken) + len(group) > limits.max_batch_size or budget <= 0:
            break
        if fanout.prefill_tokens(group) > budget and (len(group) > 1 or not room.chunking):
            break
        if not _allocate(allocator, group, room.longest_resume):
            stats.kv_waits += 1
            break
        fanout.share_prompt(group)
        for head in group:
            queue.popleft()
            head.admitted = time.perf_counter()
        tokens += (
            _chunk(group[0], budget, stats) if len(group) == 1 else fanout.prefill_tokens(group)
        )
        taken += group
    return taken


def _allocate(allocator: BlockAllocator, group: list[Entry], longest: int | None) -> bool:
    """Blocks for every member, or for none (the group waits)."""
    if len(group) > 1 and not kv_blocks.group_fits(allocator, group, longest):
        return False
    for entry in group:
        entry.allocation = kv_blocks.admit(allocator, entry, longest)
        if entry.allocation is None:
            for earlier in group:
                if earlier.allocation is not None:
                    allocator.free(earlier.allocation)
                    earlier.allocation = None
            return False
    return True


def _chunk(head: Entry, budget: int, stats: SchedulerStats) -> int:
    """A lone request's chunk_len (None: its whole prompt fits); returns the tokens it computes
    now."""
    computed = head.prefill_length - head.allocation.cache_len
    head.chunk_len = budget if computed > budget else None
    if head.chunk_len is not None:
        stats.chunked_prompts += 1
    return min(computed, budget)


def make_batch(batch_id: int, entries: list[Entry]) -> Batch:
    # Copies: the caller's Request stays as it was submitted.
    # A resumed request's prompt logprobs were sent with its first prefill already.
    requests = [
        replace(
            e.request,
            blocks=list(e.allocation.blocks),
            slots=list(e.allocation.slots),
            cache_len=e.allocation.cache_len,
            chunk_len=e.chunk_len,
            prefill_logprobs=e.request.prefill_logprobs and not e.generated,
        )
        for e in entries
    ]
    return Batch(
        batch_id,
        requests,
        size=len(requests),
        max_tokens=sum(e.tokens for e in entries),
        max_blocks=sum(len(e.allocation.blocks) for e in entries),
    )
