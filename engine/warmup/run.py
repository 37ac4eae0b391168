"""Warmup: run the largest prefill, size the KV cache from free memory, plan the buckets, warm them.

Modes: `full` warms every bucket before the shard answers Warmup; `progressive` warms a small
covering set first (any batch within the limits can run, split into those buckets), answers, then
warms the rest in a background thread, each bucket usable once warmed; `none` warms nothing and
lets every shape run eagerly (debugging only: on a graph device every new shape compiles).
Memory sizing lives in memory.py, warming one bucket after another in warm.py, the background
warming in progressive.py.
"""
from __future__ import annotations

import logging

from engine.buckets.grid import BucketLimits, BucketPlan
from engine.config import WARMUP_MODES, ServingLimits
from engine.runner import ModelRunner
from engine.warmup.progressive import start_progressive
from engine.warmup.warm import PhaseLog, report, warm_buckets, warmup_order

log = logging.getLogger(__name__)


def bucket_limits(limits: ServingLimits, block_size: int, kv_blocks: int, chunked: bool = False) -> BucketLimits:
    """The planner's limits for a cache of kv_blocks blocks (block 0 is reserved, not usable).
    `chunked`: prompts beyond the prefill budget run in chunks (engine/serving/chunks.py), so the
    longest prefill is a chunk, and prompts only set how much context a chunk continues."""
    if chunked and limits.max_input_tokens > limits.max_prefill_tokens:
        return BucketLimits(limits.max_batch_size, limits.max_prefill_tokens, limits.max_total_tokens,
                            limits.max_prefill_tokens, block_size, kv_blocks - 1, limits.max_input_tokens)
    return BucketLimits(limits.max_batch_size, limits.max_input_tokens, limits.max_total_tokens,
                        limits.max_prefill_tokens, block_size, kv_blocks - 1)


def build_plan(limits: ServingLimits, block_size: int, kv_blocks: int, strategy: str = "exponential") -> BucketPlan:
    from engine.buckets.plan import make_plan

    return make_plan(strategy, bucket_limits(limits, block_size, kv_blocks))


def plan_for(config, limits: BucketLimits, fingerprint: dict, graphless: bool = False) -> BucketPlan:
    """The shard's buckets: a warmup profile's exactly (with its latencies), else the strategy's;
    `graphless` (a device that compiles nothing) adds a decode bucket for every batch size."""
    from engine.buckets.plan import make_plan, with_every_decode_batch

    if config.warmup_profile:
        from engine.warmup.profile import plan_from_profile

        return plan_from_profile(config.warmup_profile, limits, fingerprint)
    shapes = None
    if config.bucket_shapes:
        from engine.buckets.shapes import load_shapes

        shapes = load_shapes(config.bucket_shapes)
    plan = make_plan(config.bucket_strategy, limits, shapes, config.bucket_file, config.max_graphs,
                     prefix_caching=config.prefix_caching)
    return with_every_decode_batch(plan) if graphless else plan


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
    mode = lockstep_mode(mode, runner.adapter)
    if mode == "progressive":
        return start_progressive(runner, plan, limits, prompt_logprobs, show_progress, lock, phases)
    phases.buckets += warm_buckets(runner, warmup_order(plan.prefill + plan.decode), prompt_logprobs, show_progress,
                                   lock=lock)
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
    log.warning("--warmup progressive with %d shards on %s in %s mode: every bucket is warmed before the shard "
                "answers (full), since a background warmup forward would run its collectives out of step with "
                "the other shards' serving steps", adapter.world_size, adapter.name, adapter.graph_mode)
    return "full"


def preflight(config, fingerprint: dict) -> None:
    """Check the warmup inputs named on the command line at start, not at the router's Warmup call
    minutes later: a profile from another setup, a malformed trace or bucket file."""
    if config.warmup_profile:
        from engine.warmup.profile import check_fingerprint, read_profile

        check_fingerprint(config.warmup_profile, read_profile(config.warmup_profile).get("fingerprint", {}), fingerprint)
    if config.bucket_shapes:
        from engine.buckets.shapes import load_shapes

        load_shapes(config.bucket_shapes)
    if config.bucket_file:
        from engine.buckets.plan import load_bucket_file

        load_bucket_file(config.bucket_file)
