"""KV blocks on demand (docs/architecture.md#kv-on-demand): before each Decode, every request
in the step gets the block its next token needs. When none is left, the newest request is preempted:
the shard drops it (FilterBatch), its blocks go back (its full blocks stay in the prefix cache), and
it waits at the head of the queue. Readmitted, it is prefilled again from its prompt and the tokens
it generated (the resume path of engine/serving/resume.py), so its stream goes on without a
duplicate or a gap.

This module decides who gets a block and who gives theirs back; the scheduler owns the queue and
the shard's batches, and asks it with what it holds (`grow`, `park`).
"""

from __future__ import annotations

import logging

from router.sched import kv_blocks
from router.sched.allocator import BlockAllocator
from router.sched.scheduler_stats import SchedulerStats
from router.sched.streams import Entry

log = logging.getLogger(__name__)


def needs_block(entry: Entry, block_size: int) -> bool:
    """Whether this Decode writes past its blocks: it feeds its latest token, at position
    input_length + generated - 1."""
    held = len(entry.allocation.blocks) * block_size if entry.allocation is not None else None
    return held is not None and held < entry.input_length + len(entry.generated)


def grow(allocator: BlockAllocator, entries: list[Entry], grown: dict) -> Entry | None:
    """Give every entry of the step the blocks its next token needs, adding each to `grown`
    (request id -> blocks gained). Returns the entry to preempt when the allocator runs out (the
    caller drops it and asks again), or None when every entry has its block."""
    while True:
        short = next((e for e in entries if needs_block(e, allocator.block_size)), None)
        if short is None:
            return None
        bigger = allocator.grow(short.allocation)
        if bigger is None:
            return victim(entries)
        grown.setdefault(short.id, []).append(bigger.blocks[-1])
        short.allocation = bigger


def victim(entries: list[Entry]) -> Entry:
    """Cancelled requests go first (nothing is lost), then the newest admitted."""
    return max(entries, key=lambda e: (not e.live, e.admitted or 0.0, e.id))


def park(allocator: BlockAllocator, victim: Entry, stats: SchedulerStats) -> bool:
    """Give back a live victim's blocks, keeping its prefix cached for its return; True when it
    should wait at the head of the queue, False when it is done with (cancelled or finished)."""
    if not (victim.live and victim.allocation is not None):
        return False
    log.info(
        "KV cache full: preempting request %d after %d tokens", victim.id, len(victim.generated)
    )
    stats.preemptions += 1
    kv_blocks.finished(allocator, victim)  # its prefix stays cached for its return
    allocator.free(victim.allocation)
    victim.allocation = None
    return True
