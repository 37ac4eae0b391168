"""The `fitted` strategy: for a recorded trace and a budget of graphs, the buckets that pad it
least.

Published strategies place buckets on a fixed grid, wherever traffic is. Here the budget goes where
the trace is dense, under the same coverage guarantees: a prefill bucket for the longest prompt
(any prefill can then run, split if it must) and, for every batch value, a decode bucket for its
largest possible block count (any decode within the limits runs unsplit).

- Prefill: greedy. Start from the covering bucket, then repeatedly add the (batch, length) bucket,
  from the trace's own values, that removes the most padded tokens. Padding removed by a bucket
  only shrinks as others are added (diminishing returns), which is when greedy choices are good.
- Decode: exact within a family. The runner picks the fewest rows first, so a decode shape lands
  in the smallest batch value that holds it and the problem separates: choose batch values (a 1-D
  dynamic program on rows; batch sizes 1, 2 and 4 are always among them), then block values inside
  each batch group (a 1-D dynamic program per group), and share the graphs among groups by a
  knapsack over their cost curves.
- Prefill and decode share max_graphs: each phase gives a cost curve over graph counts, and the
  split minimises prefill waste plus decode waste (rows and blocks weighted equally).
"""

from __future__ import annotations

from collections import Counter, defaultdict

import numpy as np

from engine.buckets.grid import (
    BucketLimits,
    BucketPlan,
    DecodeBucket,
    PrefillBucket,
    small_decode_batches,
)
from engine.buckets.trace_cost import decode_outside, prefill_outside

MAX_CANDIDATES = 256  # block values one decode group considers (quantiles beyond that)
MAX_PREFILL_CELLS = 4_000_000  # candidate x point matrix of the prefill greedy
# Prefill bucket lengths lie on this grid whatever the KV block size: prefill writes the KV cache by
# slot, so a bucket's length need not be a multiple of the block size (the grid strategies use the
# block size, 128 on HPU, and pad a 129-token prompt to 256).
SEQ_STEP = 16


def _round_up(value: int, step: int) -> int:
    return -(-value // step) * step


# ---------------------------------------------------------------------------------- prefill


def _prefill_points(limits: BucketLimits, counts: Counter, seq_step: int) -> Counter:
    """(batch, length rounded up to seq_step) -> occurrences; bucket lengths are on that grid
    too."""
    points = Counter()
    for (b, s), n in counts.items():
        if prefill_outside(limits, b, s) is None:
            points[(b, min(_round_up(s, seq_step), limits.max_input_tokens))] += n
    return points


def _prefill_candidates(limits: BucketLimits, points: Counter) -> list[PrefillBucket]:
    batches = sorted({b for b, _ in points} | {1})
    lengths = sorted({s for _, s in points} | {limits.max_input_tokens})
    return [
        PrefillBucket(b, s) for b in batches for s in lengths if b * s <= limits.max_prefill_tokens
    ]


def _chunked_tokens(candidates: list[PrefillBucket], points: list[tuple[int, int]]) -> np.ndarray:
    """[candidate, point] padded tokens of running the point in chunks of that bucket (inf: too
    short). An upper bound on the runner's optimal split, exact when one bucket holds the whole
    batch."""
    rows = np.array([b for b, _ in points], dtype=np.float64)
    lengths = np.array([s for _, s in points])
    cand_b = np.array([c.batch_size for c in candidates], dtype=np.float64)[:, None]
    cand_s = np.array([c.seq_len for c in candidates])[:, None]
    tokens = np.ceil(rows[None, :] / cand_b) * cand_b * cand_s
    return np.where(lengths[None, :] <= cand_s, tokens, np.inf)


def prefill_curve(limits: BucketLimits, counts: Counter, seq_step: int, max_buckets: int):
    """[(padded tokens, buckets)] for 1..max_buckets prefill buckets, chosen greedily."""
    points = _prefill_points(limits, counts, seq_step)
    cover = PrefillBucket(1, limits.max_input_tokens)
    while len(points) * len(_prefill_candidates(limits, points)) > MAX_PREFILL_CELLS:
        seq_step *= 2  # a huge trace: coarser lengths keep the matrix in memory
        points = _prefill_points(limits, counts, seq_step)
    if not points:
        return [(0.0, [cover])]
    keys = list(points)
    weights = np.array([points[k] for k in keys], dtype=np.float64)
    candidates = _prefill_candidates(limits, points)
    tokens = _chunked_tokens(candidates, keys)
    current = tokens[candidates.index(cover)]
    chosen, curve = [cover], [(float(weights @ current), [cover])]
    while len(chosen) < max_buckets:
        gains = (np.clip(current[None, :] - tokens, 0, None) * weights[None, :]).sum(axis=1)
        best = int(np.argmax(gains))
        if gains[best] <= 0:
            break  # every point already sits in a bucket of its exact shape
        chosen.append(candidates[best])
        current = np.minimum(current, tokens[best])
        curve.append((float(weights @ current), list(chosen)))
    return curve


# ---------------------------------------------------------------------------------- decode


def _layers_1d(points: Counter, candidates: list[int], max_layers: int):
    """Optimal bucket values among `candidates` (the last is mandatory and >= every point) for
    points {value: weight}: for L = 1..max_layers, (sum of weight x padding, chosen values)."""
    u = np.array(candidates, dtype=np.float64)
    xs = np.array(sorted(points), dtype=np.float64)
    ws = np.array([points[x] for x in sorted(points)], dtype=np.float64)
    upto = np.searchsorted(xs, u, side="right")  # points <= u_j
    W = np.concatenate([[0.0], np.cumsum(ws)])[upto]
    S = np.concatenate([[0.0], np.cumsum(ws * xs)])[upto]
    n = len(u)
    alone = u * W - S  # one bucket at u_j for every point <= u_j
    below = np.tril(np.ones((n, n), dtype=bool))  # mask i >= j: i must be a smaller bucket
    layer, parents, results = alone, [], []
    for depth in range(min(max_layers, n)):
        if depth:
            joined = layer[:, None] - W[:, None] * u[None, :] + S[:, None] + alone[None, :]
            joined[below] = np.inf
            parents.append(np.argmin(joined, axis=0))
            layer = joined[parents[-1], np.arange(n)]
        results.append((float(layer[-1]), _backtrack(candidates, parents, n - 1)))
    return results


def _backtrack(candidates: list[int], parents: list[np.ndarray], last: int) -> list[int]:
    chosen = [last]
    for parent in reversed(parents):
        chosen.append(int(parent[chosen[-1]]))
    return sorted(candidates[i] for i in chosen)


def _block_candidates(points: Counter, low: int, top: int) -> list[int]:
    """Bucket values for one group: its distinct block counts (quantiles of them when too many),
    never below `low` (a bucket has at least a block per row), ending at the mandatory `top`."""
    values = sorted({min(max(k, low), top) for k in points})
    if len(values) >= MAX_CANDIDATES:
        cumulative = np.cumsum([points[k] for k in sorted(points)])
        marks = np.linspace(0, cumulative[-1], MAX_CANDIDATES)[1:-1]
        values = sorted(
            {min(max(sorted(points)[i], low), top) for i in np.searchsorted(cumulative, marks)}
        )
    return sorted(set(values) | {top})


def _decode_points(limits: BucketLimits, counts: Counter) -> dict[int, Counter]:
    """batch size -> {num_blocks: occurrences}, for the shapes within the limits."""
    by_batch: dict[int, Counter] = defaultdict(Counter)
    for (b, k), n in counts.items():
        if decode_outside(limits, b, k) is None:
            by_batch[b][k] += n
    return by_batch


class _DecodeGroups:
    """Block-value cost curves of batch groups (lo, hi], cached: many batch splits share groups."""

    def __init__(self, limits: BucketLimits, by_batch: dict[int, Counter], max_layers: int):
        self.limits, self.by_batch, self.max_layers = limits, by_batch, max_layers
        self._cache: dict[tuple[int, int], list] = {}

    def curve(self, lo: int, hi: int) -> list[tuple[float, list[int]]]:
        if (lo, hi) not in self._cache:
            points = Counter()
            for b, blocks in self.by_batch.items():
                if lo < b <= hi:
                    points.update(blocks)
            top = min(hi * self.limits.blocks_per_sequence, self.limits.max_kv_blocks)
            points = points or Counter({top: 0})
            self._cache[(lo, hi)] = _layers_1d(
                points, _block_candidates(points, hi, top), self.max_layers
            )
        return self._cache[(lo, hi)]


def _knapsack(curves: list[list[tuple[float, list[int]]]], budget: int):
    """Share `budget` graphs among groups (each at least one): best[g] = (cost, per-group
    counts)."""
    best = {0: (0.0, [])}
    for curve in curves:
        step = {}
        for used, (cost, counts) in best.items():
            for extra, (group_cost, _) in enumerate(curve[: budget - used], 1):
                option = (cost + group_cost, counts + [extra])
                if used + extra not in step or option[0] < step[used + extra][0]:
                    step[used + extra] = option
        best = step
    return best


def mandatory_decode_batches(limits: BucketLimits) -> list[int]:
    top = min(limits.max_batch_size, limits.max_kv_blocks)
    return sorted(set(small_decode_batches(top)) | {top})


def _batch_curve(rows: Counter, ends: list[int], max_layers: int) -> list[tuple[float, list[int]]]:
    """[(row padding, batch values)] for each count of batch values that holds the mandatory ones
    (`ends`: mandatory_decode_batches). Those cut the batch axis into segments fitted independently,
    then the values are shared among the segments like block values among groups."""
    curves = []
    for lo, hi in zip([0] + ends[:-1], ends):
        points = Counter({b: n for b, n in rows.items() if lo < b <= hi}) or Counter({hi: 0})
        curves.append(_layers_1d(points, sorted(set(points) | {hi}), max_layers))
    shares = _knapsack(curves, max_layers)
    return [
        (cost, sorted(v for curve, count in zip(curves, counts) for v in curve[count - 1][1]))
        for _, (cost, counts) in sorted(shares.items())
    ]


def decode_curve(limits: BucketLimits, counts: Counter, max_buckets: int):
    """[(objective, buckets)] for 1..max_buckets decode buckets, objective = row padding / real
    rows + block padding / real blocks, halved (one unit per phase, like prefill's)."""
    by_batch = _decode_points(limits, counts)
    top = min(limits.max_batch_size, limits.max_kv_blocks)
    rows = Counter({b: sum(c.values()) for b, c in by_batch.items()}) or Counter({top: 0})
    real_rows = max(1.0, sum(b * n for b, n in rows.items()))
    real_blocks = max(1.0, sum(k * n for c in by_batch.values() for k, n in c.items()))
    groups = _DecodeGroups(limits, by_batch, max_buckets)
    best: dict[int, tuple[float, list]] = {}
    for row_cost, batch_values in _batch_curve(rows, mandatory_decode_batches(limits), max_buckets):
        bounds = list(zip([0] + batch_values[:-1], batch_values))
        shares = _knapsack([groups.curve(lo, hi) for lo, hi in bounds], max_buckets)
        for used, (block_cost, per_group) in shares.items():
            objective = 0.5 * row_cost / real_rows + 0.5 * block_cost / real_blocks
            if used not in best or objective < best[used][0]:
                best[used] = (objective, _decode_buckets(groups, bounds, per_group))
    return [best[g] for g in sorted(best)]


def _decode_buckets(groups: _DecodeGroups, bounds, per_group: list[int]) -> list[DecodeBucket]:
    return [
        DecodeBucket(hi, blocks)
        for (lo, hi), count in zip(bounds, per_group)
        for blocks in groups.curve(lo, hi)[count - 1][1]
    ]


# ---------------------------------------------------------------------------------- together


def fit_plan(limits: BucketLimits, shapes, max_graphs: int, seq_step: int) -> BucketPlan:
    """The plan of at most max_graphs buckets that pads the trace `shapes` least (see module
    doc)."""
    mandatory = mandatory_decode_batches(limits)
    if max_graphs < 1 + len(mandatory):
        raise ValueError(
            f"--max-graphs {max_graphs} cannot cover the limits: the fitted strategy needs at "
            f"least {1 + len(mandatory)} graphs (a prefill bucket for the longest prompt and a "
            f"decode bucket for each batch size of {', '.join(map(str, mandatory))})"
        )
    from engine.buckets.shapes import count_shapes

    prefill_counts, decode_counts = count_shapes(shapes, "prefill"), count_shapes(shapes, "decode")
    prefill = prefill_curve(limits, prefill_counts, seq_step, max_graphs - len(mandatory))
    decode = decode_curve(limits, decode_counts, max_graphs - 1)
    real_tokens = max(
        1.0,
        sum(
            b * s * n
            for (b, s), n in prefill_counts.items()
            if prefill_outside(limits, b, s) is None
        ),
    )
    options = []
    for padded, prefill_buckets in prefill:
        for objective, decode_buckets in decode:
            graphs = len(prefill_buckets) + len(decode_buckets)
            if graphs <= max_graphs:
                options.append(
                    (
                        (padded - real_tokens) / real_tokens + objective,
                        graphs,
                        prefill_buckets,
                        decode_buckets,
                    )
                )
    _, _, prefill_buckets, decode_buckets = min(options, key=lambda o: (o[0], o[1]))
    return BucketPlan(
        tuple(sorted(set(prefill_buckets), key=lambda b: (b.batch_size, b.seq_len))),
        tuple(sorted(set(decode_buckets), key=lambda b: (b.batch_size, b.num_blocks))),
    )
