"""What the scheduler's loop did, for tests and metrics."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field


@dataclass
class SchedulerStats:
    """What the loop did, for tests and metrics: batch size -> how many steps ran with it."""

    prefill_sizes: Counter = field(default_factory=Counter)
    decode_sizes: Counter = field(default_factory=Counter)
    prefills_while_running: int = 0  # continuous batching: admissions next to a running batch
    kv_waits: int = 0  # times the head of the queue waited for KV blocks
    failed_steps: int = 0
    chunked_prompts: int = (
        0  # prompts admitted with a chunk_len (the shard computes the rest later)
    )
    preemptions: int = 0  # running requests sent back to the queue for lack of KV blocks
