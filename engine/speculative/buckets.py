"""The verify buckets: `(batch, K + 1, context blocks)`, one graph each, warmed with the others.

A verify forward is a prefill that continues cached context (engine/attention/context.py): each
row's latest token and its proposals are its new tokens, everything before them its context. Rows
that propose fewer than K tokens are padded to the width, so one width serves every step; the
context dimension ranges like the context buckets' (exponential, one block at the finest) up to a
whole sequence. Only small batches get verify buckets (SPECULATE_MAX_BATCH): there a step is bound
by reading the weights and K + 1 tokens cost about what one does; larger batches decode plainly.
"""

from __future__ import annotations

from engine.buckets.grid import (
    BucketLimits,
    BucketPlan,
    VerifyBucket,
    exponential_range,
    small_decode_batches,
)

# The largest batch that speculates. Measured on the 2-core CPU (docs/benchmarks.md, speculative
# decoding, scripts/bench_spec_batches.py): a verify step costs 1.3-2.0 plain decode steps up to 4
# rows and 2.0-2.6 at 8 and 16, so above 4 rows only near-copies pay (a rewrite: 1.5-1.6x at 8-16)
# while free text loses more (0.56x at 8, 0.52x at 16, against 0.65-0.89x at 1-4).
SPECULATE_MAX_BATCH = 4

# What a verify step costs, in plain decode steps of the same rows, by the verify batch that holds
# them (the same measurements: tokens emitted per row and verify step over the speed ratio, 1.2-1.6
# at one row, 1.4-1.9 at two, 1.8-2.1 at four, the low ends where few tokens are accepted). A
# verify step pays while each row emits more than this: one token plus its accepted proposals.
VERIFY_COST = {1: 1.3, 2: 1.5, 4: 2.0}
# While it does not pay, the batch decodes plainly and measures again: an n-gram row checks every
# step, for free, what its proposal would have had accepted; a draft model or EAGLE-3 head runs one
# verify step with all of K after every PROBE_INTERVAL plain steps.
PROBE_INTERVAL = 16


def verify_cost(rows: int) -> float:
    """VERIFY_COST of the smallest verify batch holding `rows` (the largest beyond them all)."""
    fitting = [batch for batch in VERIFY_COST if batch >= rows]
    return VERIFY_COST[min(fitting)] if fitting else VERIFY_COST[max(VERIFY_COST)]


def verify_buckets(limits: BucketLimits, num_speculative_tokens: int) -> list[VerifyBucket]:
    """Every verify bucket of a plan speculating `num_speculative_tokens` tokens a row."""
    top_batch = min(SPECULATE_MAX_BATCH, limits.max_batch_size, limits.max_kv_blocks)
    contexts = exponential_range(1, 1, limits.blocks_per_sequence)
    return [
        VerifyBucket(batch, num_speculative_tokens + 1, context)
        for batch in small_decode_batches(top_batch)
        for context in contexts
        if batch * context <= limits.max_kv_blocks
    ]


def with_verify(plan: BucketPlan, buckets: list[VerifyBucket]) -> BucketPlan:
    return BucketPlan(plan.prefill, plan.decode, plan.latency, tuple(buckets))


def graph_budget_left(max_graphs: int | None, verify: list[VerifyBucket]) -> int | None:
    """--max-graphs counts the verify buckets too: what is left for prefill and decode."""
    if max_graphs is None or not verify:
        return max_graphs
    left = max_graphs - len(verify)
    if left < 2:
        raise ValueError(
            f"--max-graphs {max_graphs} leaves no room for prefill and decode buckets beside "
            f"the {len(verify)} verify buckets of --speculate (raise it, or lower "
            "--max-total-tokens)"
        )
    return left


def warm_verify_gathers(runner, vocab_size: int) -> None:
    """Where graphs compile: every gather of one verified position's rows from a verify bucket's
    output ([batch * width, vocab]) into each sampler row count (engine/speculative/step.py)."""
    if runner is None or not runner.adapter.warm_runs_forward or not runner.plan.verify:
        return
    import torch

    from engine.devices.row_merge import gather_rows

    adapter = runner.adapter
    sizes = sorted({bucket.batch_size for bucket in runner.plan.decode})
    for flat in sorted({b.batch_size * b.width for b in runner.plan.verify}):
        source = adapter.to_device(torch.zeros(flat, vocab_size))  # the models' logits: float32
        for rows in sizes:
            gather_rows(adapter, source, [0], rows)
