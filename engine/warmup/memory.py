"""Warmup's memory steps: free memory after the largest prefill, and the KV cache sized from it."""

from __future__ import annotations

from engine.buckets.grid import BucketPlan, PrefillBucket
from engine.config import ServingLimits
from engine.errors import CapacityError
from engine.kv_cache import KVCache, blocks_needed
from engine.runner import ModelRunner
from engine.sampling.penalty_counts import table_bytes


def profile_free_memory(model, adapter, dtype, block_size: int, limits: ServingLimits) -> int:
    """Free memory after the largest prefill, run on a one-block cache (padding writes only block
    0), less the static sampler's penalty count tables (engine/sampling/penalty_counts.py), which
    are made after the KV cache and live as long as it.

    Where warming runs no forward (eager CPU), neither does this: activations come and go in host
    memory, and what the KV cache does not take of it (kv_cache_memory_fraction) is their room;
    the sampler there counts penalties on the host, with no tables."""
    if not adapter.warm_runs_forward:
        return adapter.memory_info()[0]
    config = model.config
    scratch = KVCache(
        config.num_layers,
        1,
        block_size,
        model.local_kv_heads,
        config.head_dim,
        dtype,
        adapter.torch_device,
    )
    longest = min(
        limits.max_input_tokens, limits.max_prefill_tokens
    )  # longer prompts come in chunks
    rows = max(1, min(limits.max_batch_size, limits.max_prefill_tokens // longest))
    largest = PrefillBucket(rows, longest)
    plan = BucketPlan(prefill=(largest,), decode=())
    with adapter.profiling():  # no graph is captured on a cache that is freed right after
        # the prompt-logprobs variant: the plain forward's memory and the [tokens, vocab] logits
        ModelRunner(model, adapter, scratch, plan, dtype).warm(
            largest, prompt_logprobs=True, plain=False
        )
    adapter.synchronize()
    # the decode buckets' batch sizes, hence the tables' slots, are at most max_batch_size
    tables = table_bytes(limits.max_batch_size, config.vocab_size)
    return max(0, adapter.memory_info()[0] - tables)


def size_kv_cache(
    free_bytes: int, fraction: float, bytes_per_block: int, block_size: int, limits: ServingLimits
) -> int:
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
