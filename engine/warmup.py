"""Warmup: size the KV cache from free memory, plan the buckets, run every bucket once."""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from tqdm import tqdm

from engine.buckets import BucketLimits, BucketPlan, PrefillBucket, plan_buckets
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


def build_plan(limits: WarmupLimits, block_size: int, kv_blocks: int, strategy: str) -> BucketPlan:
    return plan_buckets(
        BucketLimits(
            max_batch_size=limits.max_batch_size,
            max_input_tokens=limits.max_input_tokens,
            max_total_tokens=limits.max_total_tokens,
            max_prefill_tokens=limits.max_prefill_tokens,
            block_size=block_size,
            max_kv_blocks=kv_blocks - 1,
        ),
        strategy,
    )


def warm_all(runner: ModelRunner, plan: BucketPlan, prompt_logprobs: bool = True, show_progress: bool = True) -> float:
    """Run every bucket once, largest first (so memory peaks early); returns seconds spent.
    With prompt_logprobs, prefill buckets also warm their variant that scores every prompt token."""
    buckets = sorted(plan.prefill, key=lambda b: -b.tokens) + sorted(plan.decode, key=lambda b: (-b.batch_size, -b.num_blocks))
    start = time.perf_counter()
    with tqdm(buckets, desc="warmup", unit="bucket", disable=not show_progress) as bar:
        for bucket in bar:
            bar.set_postfix_str(_describe(bucket))
            runner.warm(bucket, prompt_logprobs)
    seconds = time.perf_counter() - start
    log.info("warmed %d prefill + %d decode buckets in %.1fs", len(plan.prefill), len(plan.decode), seconds)
    return seconds


def _describe(bucket) -> str:
    if isinstance(bucket, PrefillBucket):
        return f"prefill bs={bucket.batch_size} seq={bucket.seq_len}"
    return f"decode bs={bucket.batch_size} blocks={bucket.num_blocks}"

