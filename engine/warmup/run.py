"""Warmup: run the largest prefill, size the KV cache from free memory, plan the buckets, warm them
(`start_up`, which Shard.warmup calls with its model and limits).

Modes: `full` warms every bucket before the shard answers Warmup; `progressive` warms a small
covering set first (any batch within the limits can run, split into those buckets), answers, then
warms the rest in a background thread, each bucket usable once warmed; `none` warms nothing and
lets every shape run eagerly (debugging only: on a graph device every new shape compiles).
Memory sizing lives in memory.py, warming one bucket after another in warm.py, the background
warming in progressive.py.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace

from engine.buckets.grid import BucketLimits, BucketPlan
from engine.config import WARMUP_MODES, EngineConfig, ServingLimits
from engine.distributed import Parallel, min_across_ranks
from engine.kv_cache import KVCache
from engine.layers.pooling import Pooler, can_pool
from engine.runner import ModelRunner
from engine.warmup.budget import GraphBudget, split_free_memory
from engine.warmup.memory import profile_free_memory, size_kv_cache
from engine.warmup.progressive import BackgroundWarmup, DeviceLock, start_progressive
from engine.warmup.warm import (
    PhaseLog,
    report,
    warm_buckets,
    warm_image_buckets,
    warmup_order,
)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShardModel:
    """What a shard brings to its warmup: the loaded model and where it runs."""

    model: object  # its local_kv_heads: this rank's share of the KV heads
    model_config: object  # engine.models.config.ModelConfig
    adapter: object  # engine.devices: the device adapter
    dtype: object  # torch.dtype
    block_size: int
    parallel: Parallel
    tower: object = None  # a vision-language model's ImageEncoder (engine/vision/encoder.py)


@dataclass
class Warmed:
    """A warmed shard's device state."""

    runner: ModelRunner  # the model, its KV cache and its bucket plan
    background: BackgroundWarmup | None  # progressive warmup still warming buckets
    phases: PhaseLog  # per-phase and per-bucket times and memory
    num_blocks: int  # KV blocks, block 0 (reserved) included


def start_up(
    shard: ShardModel,
    config: EngineConfig,
    limits: ServingLimits,
    fingerprint: dict,
    show_progress: bool,
    lock: DeviceLock,
) -> Warmed:
    """The start-up sequence: the largest prefill measures free memory (the least of all ranks),
    which sizes the KV cache and the graphs' reserve; then the buckets are planned for that cache
    and warmed per --warmup-mode. The caller has dropped its previous runner, so that its cache is
    not counted as used memory."""
    adapter = shard.adapter
    phases = PhaseLog(adapter)
    free = profile_free_memory(shard.model, adapter, shard.dtype, shard.block_size, limits)
    phases.mark("largest prefill")
    # Every rank sizes the same cache: the one that fits on the rank with the least memory.
    free = min_across_ranks(free, shard.parallel)
    cache, graph_bytes = _kv_cache(shard, config, limits, free)
    adapter.graph_budget = GraphBudget(adapter, graph_bytes) if graph_bytes else None
    phases.mark("kv cache")
    planned = bucket_limits(
        limits, shard.block_size, cache.num_blocks, chunked=config.prefix_caching
    )
    tower = shard.tower
    images = tower.limits if tower is not None else None
    plan = plan_for(
        config, planned, fingerprint, graphless=not adapter.warm_runs_forward, images=images
    )
    runner = ModelRunner(shard.model, adapter, cache, plan, shard.dtype)
    if config.pooling != "none" and can_pool(shard.model) is None:
        runner.pooler = Pooler(shard.model, config.pooling)  # warmed with each plain prefill bucket
    if tower is not None:  # first: few, and the encoder runs them from the first request on
        tower.planned = plan.images
        if config.warmup_mode != "none" and tower.limits is None:
            tower.warm()  # a dynamic-resolution tower: its own planned grids
            phases.mark("image buckets")
        elif config.warmup_mode != "none":
            phases.buckets += warm_image_buckets(tower, plan.images, show_progress, lock)
            phases.mark("image buckets")
    background = run_warmup(
        runner,
        plan,
        config.warmup_mode,
        planned,
        config.warmup_prompt_logprobs,
        show_progress,
        lock,
        phases,
    )
    return Warmed(runner, background, phases, cache.num_blocks)


def _kv_cache(
    shard: ShardModel, config: EngineConfig, limits: ServingLimits, free: int
) -> tuple[KVCache, int]:
    """The KV cache that `free` bytes hold, and the bytes left for graphs."""
    layers, head_dim = shard.model_config.num_layers, shard.model_config.head_dim
    kv_heads = shard.model.local_kv_heads
    per_block = KVCache.bytes_per_block(layers, shard.block_size, kv_heads, head_dim, shard.dtype)
    kv_bytes, graph_bytes = split_free_memory(
        free,
        config.kv_cache_memory_fraction,
        config.graph_memory_fraction,
        shard.adapter.captures_graphs,
    )
    num_blocks = size_kv_cache(kv_bytes, 1.0, per_block, shard.block_size, limits)
    # Pipeline stages of different layer counts would size different caches: all take the least,
    # so that they plan and warm the same buckets.
    num_blocks = min_across_ranks(num_blocks, shard.parallel)
    cache = KVCache(
        layers,
        num_blocks,
        shard.block_size,
        kv_heads,
        head_dim,
        shard.dtype,
        shard.adapter.torch_device,
        shard.adapter.zeros,
    )
    return cache, graph_bytes


def bucket_limits(
    limits: ServingLimits, block_size: int, kv_blocks: int, chunked: bool = False
) -> BucketLimits:
    """The planner's limits for a cache of kv_blocks blocks (block 0 is reserved, not usable).
    `chunked`: prompts beyond the prefill budget run in chunks (engine/serving/chunks.py), so the
    longest prefill is a chunk, and prompts only set how much context a chunk continues."""
    if chunked and limits.max_input_tokens > limits.max_prefill_tokens:
        return BucketLimits(
            limits.max_batch_size,
            limits.max_prefill_tokens,
            limits.max_total_tokens,
            limits.max_prefill_tokens,
            block_size,
            kv_blocks - 1,
            limits.max_input_tokens,
        )
    return BucketLimits(
        limits.max_batch_size,
        limits.max_input_tokens,
        limits.max_total_tokens,
        limits.max_prefill_tokens,
        block_size,
        kv_blocks - 1,
    )


def build_plan(
    limits: ServingLimits, block_size: int, kv_blocks: int, strategy: str = "exponential"
) -> BucketPlan:
    from engine.buckets.plan import make_plan

    return make_plan(strategy, bucket_limits(limits, block_size, kv_blocks))


def plan_for(
    config, limits: BucketLimits, fingerprint: dict, graphless: bool = False, images=None
) -> BucketPlan:
    """The shard's buckets: a warmup profile's exactly (with its latencies), else the strategy's;
    `graphless` (a device that compiles nothing) adds a decode bucket for every batch size.
    `images`: a vision tower's ImageLimits, whose image buckets the plan then holds too."""
    from engine.buckets.plan import image_plan, make_plan, with_every_decode_batch
    from engine.speculative.buckets import graph_budget_left, verify_buckets, with_verify

    if config.warmup_profile:
        from engine.warmup.profile import plan_from_profile

        return plan_from_profile(config.warmup_profile, limits, fingerprint, images)
    shapes = None
    if config.bucket_shapes:
        from engine.buckets.shapes import load_shapes

        shapes = load_shapes(config.bucket_shapes)
    verify = verify_buckets(limits, config.num_speculative_tokens) if config.speculate else []
    plan = make_plan(
        config.bucket_strategy,
        limits,
        shapes,
        config.bucket_file,
        graph_budget_left(config.max_graphs, verify),
        prefix_caching=config.prefix_caching,
    )
    plan = with_verify(
        with_every_decode_batch(plan, limits.blocks_per_sequence) if graphless else plan, verify
    )
    tower = image_plan(config.bucket_strategy, images, shapes, config.bucket_file)
    return replace(plan, images=tower)


def run_warmup(
    runner: ModelRunner,
    plan: BucketPlan,
    mode: str,
    limits: BucketLimits,
    prompt_logprobs: bool,
    show_progress: bool,
    lock,
    phases: PhaseLog,
):
    """Warm per `mode`; returns the background warmup still running (progressive), else None."""
    if mode not in WARMUP_MODES:
        raise ValueError(f"unknown warmup mode {mode!r} (choose from {', '.join(WARMUP_MODES)})")
    counts = f"{len(plan.prefill)} prefill + {len(plan.decode)} decode buckets"
    counts += f" + {len(plan.verify)} verify" if plan.verify else ""
    counts += f" + {len(plan.images)} image" if plan.images else ""
    if mode == "none":
        # Nothing warmed: strict shape checking would refuse every forward, so every shape runs
        # eagerly.
        runner.adapter.shapes.strict = False
        log.warning(
            "--warmup none: no bucket is warmed; every forward runs eagerly (compiling on graph "
            "devices). For debugging only."
        )
        report(f"warmup none: {counts} planned, none warmed; {phases.summary()}", show_progress)
        return None
    mode = lockstep_mode(mode, runner.adapter)
    if mode == "progressive":
        return start_progressive(runner, plan, limits, prompt_logprobs, show_progress, lock, phases)
    phases.buckets += warm_buckets(
        runner, warmup_order(plan.buckets), prompt_logprobs, show_progress, lock=lock
    )
    phases.mark("buckets")
    report(f"warmup full: {counts} ({plan.graphs} graphs) in {phases.summary()}", show_progress)
    return None


def lockstep_mode(mode: str, adapter) -> str:
    """`full` in place of `progressive` where ranks would run collectives out of step. Every rank
    gets the same steps in the same order from the router, but each one's background thread takes
    its device turns at its own moments: one rank's warmup forward would meet another's serving
    step in an all-reduce (a size mismatch, or a hang). Where warming runs no forward (CPU eager)
    no collective is at stake, so progressive stays."""
    if mode != "progressive" or adapter.world_size == 1 or not adapter.warm_runs_forward:
        return mode
    log.warning(
        "--warmup progressive with %d shards on %s in %s mode: every bucket is warmed before the "
        "shard answers (full), since a background warmup forward would run its collectives out "
        "of step with the other shards' serving steps",
        adapter.world_size,
        adapter.name,
        adapter.graph_mode,
    )
    return "full"


def preflight(config, fingerprint: dict) -> None:
    """Check the warmup inputs named on the command line at start, not at the router's Warmup call
    minutes later: a profile from another setup, a malformed trace or bucket file."""
    if config.warmup_profile:
        from engine.warmup.profile import check_fingerprint, read_profile

        check_fingerprint(
            config.warmup_profile,
            read_profile(config.warmup_profile).get("fingerprint", {}),
            fingerprint,
        )
    if config.bucket_shapes:
        from engine.buckets.shapes import load_shapes

        load_shapes(config.bucket_shapes)
    if config.bucket_file:
        from engine.buckets.plan import load_bucket_file

        load_bucket_file(config.bucket_file)
