"""Warming buckets one by one: run each bucket's forward once (compiling or capturing its graph),
with a progress bar, timing and free memory per bucket and per phase."""

from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field

from tqdm import tqdm

from engine.buckets.grid import BucketPlan, DecodeBucket, PrefillBucket, VerifyBucket
from engine.buckets.images import ImageBucket
from engine.runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass
class PhaseLog:
    """Time and free device memory at the end of each warmup phase, for the summary line."""

    adapter: object
    start: float = field(default_factory=time.perf_counter)
    phases: list = field(
        default_factory=list
    )  # (name, seconds since the previous mark, free bytes)
    buckets: list = field(default_factory=list)  # BucketWarmup of every bucket warmed, in order

    def __post_init__(self) -> None:
        self._last, self.free_at_start = self.start, self.adapter.memory_info()[0]

    def mark(self, name: str) -> None:
        self.adapter.synchronize()
        now = time.perf_counter()
        self.phases.append((name, now - self._last, self.adapter.memory_info()[0]))
        self._last = now

    def summary(self) -> str:
        """Total time and memory, then per phase, e.g. '3.2s, free memory -1.10 GiB: largest prefill
        0.4s ...'. Memory only where the adapter's memory is its own device's (not the CPU's system
        memory)."""
        memory = getattr(self.adapter, "own_memory", True)
        parts, free = [], self.free_at_start
        for name, seconds, after in self.phases:
            parts.append(f"{name} {seconds:.1f}s" + (f" {_gib(after - free)}" if memory else ""))
            free = after
        total = f"{time.perf_counter() - self.start:.1f}s"
        if memory:
            total += f", free memory {_gib(free - self.free_at_start)}"
        return f"{total}: " + ", ".join(parts)


def _gib(delta: int) -> str:
    return f"{delta / 2**30:+.2f} GiB"


@dataclass
class BucketWarmup:
    """One bucket's warmup: its first run (where a graph is compiled or captured) and memory."""

    bucket: PrefillBucket | DecodeBucket | VerifyBucket | ImageBucket
    seconds: float
    free_before: int
    free_after: int


def warmup_order(buckets) -> list:
    """Largest first, so memory peaks early: a bucket that does not fit fails in the first
    seconds."""
    return sorted(
        buckets,
        key=lambda b: (
            isinstance(b, DecodeBucket),
            -b.batch_size * bucket_size(b),
            -getattr(b, "context_blocks", 0),
        ),
    )


def bucket_size(bucket) -> int:
    if isinstance(bucket, VerifyBucket):
        return bucket.width
    return bucket.seq_len if isinstance(bucket, PrefillBucket) else bucket.num_blocks


def describe(bucket) -> str:
    if isinstance(bucket, ImageBucket):
        return f"image inputs={bucket.count} size={bucket.size}"
    if isinstance(bucket, VerifyBucket):
        return f"verify bs={bucket.batch_size} width={bucket.width} context={bucket.context_blocks}"
    if isinstance(bucket, PrefillBucket):
        context = f" context={bucket.context_blocks}" if bucket.context_blocks else ""
        return f"prefill bs={bucket.batch_size} seq={bucket.seq_len}{context}"
    return f"decode bs={bucket.batch_size} blocks={bucket.num_blocks}"


def warm_buckets(
    runner: ModelRunner,
    buckets,
    prompt_logprobs: bool,
    show_progress: bool,
    desc: str = "warmup",
    lock=None,
    on_warmed=None,
    stop: threading.Event | None = None,
) -> list[BucketWarmup]:
    """Warm `buckets` in order with a progress bar (the bucket being warmed, an ETA). Each bucket
    holds `lock` (progressive warmup shares the device with serving) and then calls on_warmed."""
    lock = lock or threading.Lock()
    budget = runner.adapter.graph_budget  # engine/warmup/budget.py; None: graphs are not limited
    done, dropped = [], []
    with tqdm(buckets, desc=desc, unit="bucket", disable=not show_progress, file=sys.stderr) as bar:
        for bucket in bar:
            if stop is not None and stop.is_set():
                break
            bar.set_postfix_str(describe(bucket))
            with lock:
                graph = budget is None or budget.allows(bucket)
                done.append(_warm_one(runner, bucket, prompt_logprobs, graph))
                if graph and budget is not None:
                    budget.spent(bucket, done[-1].free_before, done[-1].free_after)
                dropped += [] if graph else [bucket]
                if on_warmed is not None:
                    on_warmed(bucket)
    if budget is not None:
        budget.report(dropped, describe)
    return done


def _warm_one(
    runner: ModelRunner, bucket, prompt_logprobs: bool, graph: bool = True
) -> BucketWarmup:
    adapter = runner.adapter
    free_before, start = adapter.memory_info()[0], time.perf_counter()
    runner.warm(bucket, prompt_logprobs, graph=graph)
    adapter.synchronize()
    return BucketWarmup(bucket, time.perf_counter() - start, free_before, adapter.memory_info()[0])


def warm_image_buckets(tower, buckets, show_progress: bool, lock=None) -> list[BucketWarmup]:
    """Warm a vision tower's image buckets (engine/vision/encoder.py), largest first, timed like
    the others so that warmup profiles measure them too."""
    lock, adapter, done = lock or threading.Lock(), tower.adapter, []
    ordered = sorted(buckets, key=lambda b: -b.count * b.size)
    bar = tqdm(
        ordered, desc="image buckets", unit="bucket", disable=not show_progress, file=sys.stderr
    )
    with bar:
        for bucket in bar:
            bar.set_postfix_str(describe(bucket))
            with lock:
                free_before, start = adapter.memory_info()[0], time.perf_counter()
                tower.warm_bucket(bucket)
                adapter.synchronize()
                seconds = time.perf_counter() - start
                done.append(BucketWarmup(bucket, seconds, free_before, adapter.memory_info()[0]))
    return done


def warm_all(
    runner: ModelRunner, plan: BucketPlan, prompt_logprobs: bool = True, show_progress: bool = True
) -> float:
    """Run every bucket once, largest first; returns seconds spent."""
    start = time.perf_counter()
    warm_buckets(runner, warmup_order(plan.buckets), prompt_logprobs, show_progress)
    return time.perf_counter() - start


def report(message: str, show_progress: bool) -> None:
    """A summary line: on stderr next to the progress bar when there is one, else in the log."""
    if show_progress:
        print(message, file=sys.stderr, flush=True)
    else:
        log.info("%s", message)
