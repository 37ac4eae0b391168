"""Warmup: run the largest prefill, size the KV cache from free memory, plan the buckets, warm them.

Modes: `full` warms every bucket before the shard answers Warmup; `progressive` warms a small
covering set first (any batch within the limits can run, split into those buckets), answers, then
warms the rest in a background thread, each bucket usable once warmed; `none` warms nothing and
lets every shape run eagerly (debugging only: on a graph device every new shape compiles).
The background bucket warming lives in engine/progressive.py.
"""
from __future__ import annotations

import logging
import sys
import threading
import time
from dataclasses import dataclass, field

import torch
from tqdm import tqdm

from engine.buckets import BucketLimits, BucketPlan, DecodeBucket, PrefillBucket
from engine.config import WARMUP_MODES
from engine.errors import CapacityError
from engine.kv_cache import KVCache, blocks_needed
from engine.runner import ModelRunner

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WarmupLimits:
    max_batch_size: int
    max_input_tokens: int
    max_total_tokens: int
    max_prefill_tokens: int


def profile_free_memory(model, adapter, dtype, block_size: int, limits: WarmupLimits) -> int:
    """Free memory after the largest prefill, run on a one-block cache (padding writes only block 0)."""
    config = model.config
    scratch = KVCache(config.num_layers, 1, block_size, model.local_kv_heads, config.head_dim, dtype, adapter.torch_device)
    rows = max(1, min(limits.max_batch_size, limits.max_prefill_tokens // limits.max_input_tokens))
    largest = PrefillBucket(rows, limits.max_input_tokens)
    plan = BucketPlan(prefill=(largest,), decode=())
    ModelRunner(model, adapter, scratch, plan, dtype).warm(largest)
    adapter.synchronize()
    return adapter.memory_info()[0]


def size_kv_cache(free_bytes: int, fraction: float, bytes_per_block: int, block_size: int, limits: WarmupLimits) -> int:
    """Blocks for the cache (block 0 included): what memory allows, but no more than the
    max_batch_size longest sequences can ever use at once."""
    per_sequence = blocks_needed(limits.max_total_tokens, block_size)
    affordable = int(free_bytes * fraction) // bytes_per_block
    useful = limits.max_batch_size * per_sequence + 1
    if affordable < per_sequence + 1:
        raise CapacityError(
            f"KV cache too small: {affordable} blocks fit in free memory, one sequence of "
            f"max_total_tokens={limits.max_total_tokens} needs {per_sequence + 1}"
        )
    return min(affordable, useful)





def bucket_limits(limits: WarmupLimits, block_size: int, kv_blocks: int) -> BucketLimits:
    """The planner's limits for a cache of kv_blocks blocks (block 0 is reserved, not usable)."""
    return BucketLimits(limits.max_batch_size, limits.max_input_tokens, limits.max_total_tokens,
                        limits.max_prefill_tokens, block_size, kv_blocks - 1)


def build_plan(limits: WarmupLimits, block_size: int, kv_blocks: int, strategy: str = "exponential") -> BucketPlan:
    from engine.plans import make_plan

    return make_plan(strategy, bucket_limits(limits, block_size, kv_blocks))


def plan_for(config, limits: BucketLimits, fingerprint: dict) -> BucketPlan:
    """The shard's buckets: a warmup profile's exactly (with its latencies), else the strategy's."""
    from engine.plans import make_plan

    if config.warmup_profile:
        from engine.profile import plan_from_profile

        return plan_from_profile(config.warmup_profile, limits, fingerprint)
    shapes = None
    if config.bucket_shapes:
        from engine.shapes import load_shapes

        shapes = load_shapes(config.bucket_shapes)
    return make_plan(config.bucket_strategy, limits, shapes, config.bucket_file, config.max_graphs)


@dataclass
class PhaseLog:
    """Time and free device memory at the end of each warmup phase, for the summary line."""
    adapter: object
    start: float = field(default_factory=time.perf_counter)
    phases: list = field(default_factory=list)  # (name, seconds since the previous mark, free bytes)
    buckets: list = field(default_factory=list)  # BucketWarmup of every bucket warmed, in order

    def __post_init__(self) -> None:
        self._last, self.free_at_start = self.start, self.adapter.memory_info()[0]

    def mark(self, name: str) -> None:
        self.adapter.synchronize()
        now = time.perf_counter()
        self.phases.append((name, now - self._last, self.adapter.memory_info()[0]))
        self._last = now

    def summary(self) -> str:
        """Total time and memory, then per phase, e.g. '3.2s, free memory -1.10 GiB: largest prefill 0.4s ...'."""
        parts, free = [], self.free_at_start
        for name, seconds, after in self.phases:
            parts.append(f"{name} {seconds:.1f}s {_gib(after - free)}")
            free = after
        total = time.perf_counter() - self.start
        return f"{total:.1f}s, free memory {_gib(free - self.free_at_start)}: " + ", ".join(parts)


def _gib(delta: int) -> str:
    return f"{delta / 2**30:+.2f} GiB"


@dataclass
class BucketWarmup:
    """One bucket's warmup: its first run (where a graph is compiled or captured) and memory."""
    bucket: PrefillBucket | DecodeBucket
    seconds: float
    free_before: int
    free_after: int


def warmup_order(buckets) -> list:
    """Largest first, so memory peaks early: a bucket that does not fit fails in the first seconds."""
    return sorted(buckets, key=lambda b: (isinstance(b, DecodeBucket), -b.batch_size * _size(b)))


def _size(bucket) -> int:
    return bucket.seq_len if isinstance(bucket, PrefillBucket) else bucket.num_blocks


def describe(bucket) -> str:
    if isinstance(bucket, PrefillBucket):
        return f"prefill bs={bucket.batch_size} seq={bucket.seq_len}"
    return f"decode bs={bucket.batch_size} blocks={bucket.num_blocks}"


def warm_buckets(runner: ModelRunner, buckets, prompt_logprobs: bool, show_progress: bool, desc: str = "warmup",
                 lock=None, on_warmed=None, stop: threading.Event | None = None) -> list[BucketWarmup]:
    """Warm `buckets` in order with a progress bar (the bucket being warmed, an ETA). Each bucket
    holds `lock` (progressive warmup shares the device with serving) and then calls on_warmed."""
    lock = lock or threading.Lock()
    done = []
    with tqdm(buckets, desc=desc, unit="bucket", disable=not show_progress, file=sys.stderr) as bar:
        for bucket in bar:
            if stop is not None and stop.is_set():
                break
            bar.set_postfix_str(describe(bucket))
            with lock:
                done.append(_warm_one(runner, bucket, prompt_logprobs))
                if on_warmed is not None:
                    on_warmed(bucket)
    return done


def _warm_one(runner: ModelRunner, bucket, prompt_logprobs: bool) -> BucketWarmup:
    adapter = runner.adapter
    free_before, start = adapter.memory_info()[0], time.perf_counter()
    runner.warm(bucket, prompt_logprobs)
    adapter.synchronize()
    return BucketWarmup(bucket, time.perf_counter() - start, free_before, adapter.memory_info()[0])


def warm_all(runner: ModelRunner, plan: BucketPlan, prompt_logprobs: bool = True, show_progress: bool = True) -> float:
    """Run every bucket once, largest first; returns seconds spent."""
    start = time.perf_counter()
    warm_buckets(runner, warmup_order(plan.prefill + plan.decode), prompt_logprobs, show_progress)
    return time.perf_counter() - start


def report(message: str, show_progress: bool) -> None:
    """A summary line: on stderr next to the progress bar when there is one, else in the log."""
    if show_progress:
        print(message, file=sys.stderr, flush=True)
    else:
        log.info("%s", message)


def run_warmup(runner: ModelRunner, plan: BucketPlan, mode: str, limits: BucketLimits, prompt_logprobs: bool,
               show_progress: bool, lock, phases: PhaseLog):
    """Warm per `mode`; returns the background warmup still running (progressive), else None."""
    if mode not in WARMUP_MODES:
        raise ValueError(f"unknown warmup mode {mode!r} (choose from {', '.join(WARMUP_MODES)})")
    counts = f"{len(plan.prefill)} prefill + {len(plan.decode)} decode buckets"
    if mode == "none":
        # Nothing warmed: strict shape checking would refuse every forward, so every shape runs eagerly.
        runner.adapter.shapes.strict = False
        log.warning("--warmup none: no bucket is warmed; every forward runs eagerly (compiling on graph "
                    "devices). For debugging only.")
        report(f"warmup none: {counts} planned, none warmed; {phases.summary()}", show_progress)
        return None
    if mode == "progressive":
        from engine.progressive import start_progressive

        return start_progressive(runner, plan, limits, prompt_logprobs, show_progress, lock, phases)
    phases.buckets += warm_buckets(runner, warmup_order(plan.prefill + plan.decode), prompt_logprobs, show_progress,
                                   lock=lock)
    phases.mark("buckets")
    report(f"warmup full: {counts} ({plan.graphs} graphs) in {phases.summary()}", show_progress)
    return None


def preflight(config, fingerprint: dict) -> None:
    """Check the warmup inputs named on the command line at start, not at the router's Warmup call
    minutes later: a profile from another setup, a malformed trace or bucket file."""
    if config.warmup_profile:
        from engine.profile import check_fingerprint, read_profile

        check_fingerprint(config.warmup_profile, read_profile(config.warmup_profile).get("fingerprint", {}), fingerprint)
    if config.bucket_shapes:
        from engine.shapes import load_shapes

        load_shapes(config.bucket_shapes)
    if config.bucket_file:
        from engine.plans import load_bucket_file

        load_bucket_file(config.bucket_file)
