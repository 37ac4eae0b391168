"""Which queued requests the scheduler admits into its next Prefill, and the batch it sends.

Requests leave the head of the FIFO queue while the batch has rows, the prefill budget has room and
their KV blocks fit (router/kv_blocks.py); the head waits, never skipped. When the shards chunk
prompts (Info.support_chunking), a prompt longer than the budget left is admitted with
chunk_len = that room: the shard computes the rest in the following steps, next to the decodes.
"""
from __future__ import annotations

import time
from dataclasses import replace

from engine.batch import Batch
from router import kv_blocks
from router.streams import Entry


def next_batch(scheduler) -> list[Entry]:
    limits, taken, tokens = scheduler.limits, [], 0
    while scheduler._queue:
        head = scheduler._queue[0]
        room = limits.max_prefill_tokens - tokens
        if scheduler.running_count + len(taken) >= limits.max_batch_size or room <= 0:
            break
        if head.prefill_length > room and not scheduler.chunking:
            break
        head.allocation = kv_blocks.admit(scheduler.allocator, head, scheduler._longest_resume())
        if head.allocation is None:
            scheduler.stats.kv_waits += 1
            break
        scheduler._queue.popleft()
        head.admitted = time.perf_counter()
        computed = head.prefill_length - head.allocation.cache_len
        head.chunk_len = room if computed > room else None
        if head.chunk_len is not None:
            scheduler.stats.chunked_prompts += 1
        taken.append(head)
        tokens += min(computed, room)
    return taken


def make_batch(batch_id: int, entries: list[Entry]) -> Batch:
    # Copies: the caller's Request stays as it was submitted.
    # A resumed request's prompt logprobs were sent with its first prefill already.
    requests = [replace(e.request, blocks=list(e.allocation.blocks), slots=list(e.allocation.slots),
                        cache_len=e.allocation.cache_len, chunk_len=e.chunk_len,
                        prefill_logprobs=e.request.prefill_logprobs and not e.generated) for e in entries]
    return Batch(batch_id, requests, size=len(requests), max_tokens=sum(e.tokens for e in entries),
                 max_blocks=sum(len(e.allocation.blocks) for e in entries))
