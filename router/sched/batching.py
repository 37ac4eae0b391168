"""Which queued requests the scheduler admits into its next Prefill, and the batch it sends.

Requests leave the head of the FIFO queue while the batch has rows, the prefill budget has room and
their KV blocks fit (router/sched/kv_blocks.py); the head waits, never skipped. When the shards chunk
prompts (Info.support_chunking), a prompt longer than the budget left is admitted with
chunk_len = that room: the shard computes the rest in the following steps, next to the decodes.
The members of an `n`/`best_of` group (router/sched/fanout.py) are admitted together, sharing one
prefill, when their prompt fits the budget; a longer one splits them into lone requests.
"""
from __future__ import annotations

import time
from dataclasses import replace

from engine.batch import Batch
from router.sched import fanout, kv_blocks
from router.sched.streams import Entry


def next_batch(scheduler) -> list[Entry]:
    limits, taken, tokens = scheduler.limits, [], 0
    while scheduler._queue:
        group = fanout.leading_group(scheduler._queue)
        if len(group) > 1 and fanout.prefill_tokens(group) > limits.max_prefill_tokens:
            fanout.split(group)
            group = group[:1]
        room = limits.max_prefill_tokens - tokens
        if scheduler.running_count + len(taken) + len(group) > limits.max_batch_size or room <= 0:
            break
        if fanout.prefill_tokens(group) > room and (len(group) > 1 or not scheduler.chunking):
            break
        if not _allocate(scheduler, group):
            scheduler.stats.kv_waits += 1
            break
        fanout.share_prompt(group)
        for head in group:
            scheduler._queue.popleft()
            head.admitted = time.perf_counter()
        tokens += _chunk(scheduler, group[0], room) if len(group) == 1 else fanout.prefill_tokens(group)
        taken += group
    return taken


def _allocate(scheduler, group: list[Entry]) -> bool:
    """Blocks for every member, or for none (the group waits)."""
    longest = scheduler._longest_resume()
    if len(group) > 1 and not kv_blocks.group_fits(scheduler.allocator, group, longest):
        return False
    for entry in group:
        entry.allocation = kv_blocks.admit(scheduler.allocator, entry, longest)
        if entry.allocation is None:
            for earlier in group:
                if earlier.allocation is not None:
                    scheduler.allocator.free(earlier.allocation)
                    earlier.allocation = None
            return False
    return True


def _chunk(scheduler, head: Entry, room: int) -> int:
    """A lone request's chunk_len (None: its whole prompt fits); returns the tokens it computes now."""
    computed = head.prefill_length - head.allocation.cache_len
    head.chunk_len = room if computed > room else None
    if head.chunk_len is not None:
        scheduler.stats.chunked_prompts += 1
    return min(computed, room)


def make_batch(batch_id: int, entries: list[Entry]) -> Batch:
    # Copies: the caller's Request stays as it was submitted.
    # A resumed request's prompt logprobs were sent with its first prefill already.
    requests = [replace(e.request, blocks=list(e.allocation.blocks), slots=list(e.allocation.slots),
                        cache_len=e.allocation.cache_len, chunk_len=e.chunk_len,
                        prefill_logprobs=e.request.prefill_logprobs and not e.generated) for e in entries]
    return Batch(batch_id, requests, size=len(requests), max_tokens=sum(e.tokens for e in entries),
                 max_blocks=sum(len(e.allocation.blocks) for e in entries))
