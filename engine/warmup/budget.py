"""Device memory for graphs: set aside when the KV cache is sized, spent bucket by bucket in warmup.

Every captured graph (an HPU graph, a CUDA graph) keeps device memory. The KV cache is sized to
leave `graph_memory_fraction` of the usable memory to them (TGI reserves 10% likewise,
TGI_GRAPH_RESERVED_MEM). Warmup then captures:
- prefill graphs while they fit in their share of the budget (PREFILL_SHARE), judged by the largest
  prefill graph so far: prompts are few per second, and decode steps gain the most from graphs;
- decode graphs while the largest so far would still leave the budget's floor free.
A bucket whose graph would not fit is warmed to run without one (slower, never out of memory), and
the buckets so dropped are named in a warning.
"""

from __future__ import annotations

import logging

log = logging.getLogger(__name__)


def split_free_memory(
    free_bytes: int, kv_fraction: float, graph_fraction: float, captures_graphs: bool
) -> tuple[int, int]:
    """(bytes for the KV cache, bytes for graphs) out of the free memory after the largest
    prefill."""
    usable = int(free_bytes * kv_fraction)
    graphs = int(usable * graph_fraction) if captures_graphs else 0
    return usable - graphs, graphs


PREFILL_SHARE = 0.5


class GraphBudget:
    def __init__(self, adapter, budget_bytes: int):
        self.adapter, self.budget_bytes = adapter, budget_bytes
        self.floor = adapter.memory_info()[0] - budget_bytes  # free memory that graphs must leave
        self.largest: dict[str, int] = {}  # kind of bucket -> the most memory one graph of it took
        self.prefill_spent = 0

    def allows(self, bucket) -> bool:
        estimate = self.largest.get(kind(bucket), 0)
        if (
            kind(bucket) == "PrefillBucket"
            and self.prefill_spent + estimate > self.budget_bytes * PREFILL_SHARE
        ):
            return False
        return self.adapter.memory_info()[0] - estimate >= self.floor

    def spent(self, bucket, free_before: int, free_after: int) -> None:
        used = max(0, free_before - free_after)
        self.largest[kind(bucket)] = max(self.largest.get(kind(bucket), 0), used)
        if kind(bucket) == "PrefillBucket":
            self.prefill_spent += used

    def report(self, dropped: list, describe) -> None:
        if dropped:
            log.warning(
                "graph memory budget (%.1f MiB) spent: %d bucket(s) run without a graph: %s",
                self.budget_bytes / 2**20,
                len(dropped),
                ", ".join(describe(b) for b in dropped),
            )


def kind(bucket) -> str:
    return type(bucket).__name__
