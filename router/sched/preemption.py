"""KV blocks on demand (docs/architecture.md#kv-on-demand): before each Decode, every request
in the step gets the block its next token needs. When none is left, the newest request is
preempted: the shard drops it (FilterBatch), its blocks go back (its full blocks stay in the
prefix cache), and it waits at the head of the queue. Readmitted, it is prefilled again from its
prompt and the tokens it generated (the resume path of engine/serving/resume.py), so its stream
goes on without a duplicate or a gap.
"""
from __future__ import annotations

import logging

from engine.batch import CachedBatch
from router.sched import kv_blocks
from router.client import ShardError
from router.sched.streams import Entry

log = logging.getLogger(__name__)


def needs_block(entry: Entry, block_size: int) -> bool:
    """Whether this Decode writes past its blocks: it feeds its latest token, at position
    input_length + generated - 1."""
    held = len(entry.allocation.blocks) * block_size if entry.allocation is not None else None
    return held is not None and held < entry.input_length + len(entry.generated)


async def grow(scheduler, batches: list[CachedBatch]) -> tuple[list[CachedBatch], dict[int, list[int]]]:
    """The batches to decode (preemption may drop requests) and the blocks each request gained."""
    grown: dict[int, list[int]] = {}
    size = scheduler.allocator.block_size
    while True:
        entries = scheduler._entries_of(batches)
        short = next((e for e in entries if needs_block(e, size)), None)
        if short is None:
            return batches, grown
        bigger = scheduler.allocator.grow(short.allocation)
        if bigger is not None:
            grown.setdefault(short.id, []).append(bigger.blocks[-1])
            short.allocation = bigger
            continue
        # Cancelled requests go first (nothing is lost), then the newest admitted.
        victim = max(entries, key=lambda e: (not e.live, e.admitted or 0.0, e.id))
        batches = await preempt(scheduler, victim, batches)
        grown.pop(victim.id, None)


async def preempt(scheduler, victim: Entry, batches: list[CachedBatch]) -> list[CachedBatch]:
    kept = []
    for cached in batches:
        if victim.id not in cached.request_ids:
            kept.append(cached)
            continue
        rest = [i for i in cached.request_ids if i != victim.id]
        try:
            if rest:
                kept.append(await scheduler.client.filter_batch(cached.id, rest))
            else:
                await scheduler.client.clear_cache(cached.id)
        except ShardError as error:
            await scheduler._fail([cached.id], scheduler._entries_of([cached]), error)
    if victim.live and victim.allocation is not None:
        log.info("KV cache full: preempting request %d after %d tokens", victim.id, len(victim.generated))
        scheduler.stats.preemptions += 1
        kv_blocks.finished(scheduler.allocator, victim)  # its prefix stays cached for its return
        scheduler.allocator.free(victim.allocation)
        victim.allocation = None
        scheduler._queue.appendleft(victim)
    else:
        scheduler._release(victim)
    return kept
