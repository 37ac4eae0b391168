"""What a bucket plan costs on a recorded trace: real vs padded work per phase, as the runner would
pad.

A prefill shape (b, s) is b prompts padded to s (its longest); the runner may split it over
several buckets, choosing the split with the fewest padded tokens (or the least time with a
profile), so the cost here is that same optimal split of b equal rows. A decode shape (b, k) runs
in the bucket with the fewest rows, then fewest blocks, that holds it; one that no bucket holds is
split as the runner splits it, with the k blocks spread evenly over the rows.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from engine.buckets.grid import BucketLimits, BucketPlan


@dataclass
class PhaseCost:
    real: int = 0  # prefill: tokens (b x s); decode: rows
    padded: int = 0
    real_blocks: int = 0  # decode only
    padded_blocks: int = 0
    outside: Counter = field(
        default_factory=Counter
    )  # reason -> shapes outside the limits (not counted above)

    @staticmethod
    def ratio(real: int, padded: int) -> float:
        return 1.0 - real / padded if padded else 0.0

    def as_dict(self, decode: bool) -> dict:
        out = {
            "real": self.real,
            "padded": self.padded,
            "waste": self.ratio(self.real, self.padded),
        }
        if decode:
            out.update(
                real_blocks=self.real_blocks,
                padded_blocks=self.padded_blocks,
                block_waste=self.ratio(self.real_blocks, self.padded_blocks),
            )
        out["outside_limits"] = sum(self.outside.values())
        out["outside_reasons"] = dict(self.outside)
        return out


def prefill_outside(limits: BucketLimits, b: int, s: int) -> str | None:
    """Why a prefill shape is outside the limits, or None. A batch over the prefill-token budget is
    inside: a router counts real tokens, so b x longest may exceed it, and the runner splits."""
    if b > limits.max_batch_size:
        return f"batch_size > max_batch_size={limits.max_batch_size}"
    if s > limits.max_input_tokens:
        return f"seq_len > max_input_tokens={limits.max_input_tokens}"
    return None


def decode_outside(limits: BucketLimits, b: int, k: int) -> str | None:
    if b > limits.max_batch_size:
        return f"batch_size > max_batch_size={limits.max_batch_size}"
    if k < b:
        return "num_blocks < batch_size (every sequence holds a block)"
    if k > b * limits.blocks_per_sequence:
        return f"num_blocks > batch_size x {limits.blocks_per_sequence} blocks per sequence"
    if k > limits.max_kv_blocks:
        return f"num_blocks > max_kv_blocks={limits.max_kv_blocks}"
    return None


def uniform_prefill_tokens(plan: BucketPlan, rows: int, seq_len: int) -> int | None:
    """Padded tokens of the runner's best split of `rows` prompts of seq_len tokens (None: no bucket
    holds even one). The same dynamic program as BucketPlan.split_prefill, on equal lengths."""
    top = min(rows, plan.max_prefill_batch)
    bucket_for = [None] + [plan.prefill_bucket(k, seq_len) for k in range(1, top + 1)]
    if bucket_for[1] is None:
        return None
    best = [(0.0, 0, 0)]  # rows done -> (cost, forwards, padded tokens)
    for done in range(1, rows + 1):
        options = [
            (
                best[done - k][0] + plan._cost(bucket_for[k]),
                best[done - k][1] + 1,
                best[done - k][2] + bucket_for[k].tokens,
            )
            for k in range(1, min(done, top) + 1)
            if bucket_for[k] is not None
        ]
        best.append(min(options))
    return best[rows][2]


def decode_padding(plan: BucketPlan, rows: int, blocks: int) -> tuple[int, int] | None:
    """(padded rows, padded blocks) of one decode shape, or None when it cannot run at all."""
    bucket = plan.decode_bucket(rows, blocks)
    if bucket is not None:
        return bucket.batch_size, bucket.num_blocks
    per_row, extra = divmod(blocks, rows)
    counts = [per_row + (r < extra) for r in range(rows)]
    try:
        groups = plan.split_decode(counts)
    except ValueError:
        return None
    chosen = [plan.decode_bucket(len(g), sum(counts[i] for i in g)) for g in groups]
    return sum(b.batch_size for b in chosen), sum(b.num_blocks for b in chosen)


def prefill_cost(plan: BucketPlan, limits: BucketLimits, counts: Counter) -> PhaseCost:
    cost = PhaseCost()
    for (b, s), n in counts.items():
        reason = prefill_outside(limits, b, s)
        padded = None if reason else uniform_prefill_tokens(plan, b, s)
        if padded is None:
            cost.outside[reason or "no bucket holds it"] += n
            continue
        cost.real += n * b * s
        cost.padded += n * padded
    return cost


def decode_cost(plan: BucketPlan, limits: BucketLimits, counts: Counter) -> PhaseCost:
    cost = PhaseCost()
    for (b, k), n in counts.items():
        reason = decode_outside(limits, b, k)
        padded = None if reason else decode_padding(plan, b, k)
        if padded is None:
            cost.outside[reason or "no bucket holds it"] += n
            continue
        cost.real += n * b
        cost.padded += n * padded[0]
        cost.real_blocks += n * k
        cost.padded_blocks += n * padded[1]
    return cost
