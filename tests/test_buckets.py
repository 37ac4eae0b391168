"""Tests of engine.buckets.grid: ranges, plan coverage, bucket choice, splitting, padding stats."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.buckets.grid import (
    STRATEGIES,
    BucketLimits,
    BucketPlan,
    DecodeBucket,
    PaddingStats,
    PrefillBucket,
    StrategySteps,
    exponential_range,
    linear_range,
    plan_buckets,
)

FAST = settings(max_examples=60, deadline=None)


# --------------------------------------------------------------------------- ranges


def test_linear_range_examples():
    assert linear_range(1, 32, 128) == [1, 2, 4, 8, 16, 32, 64, 96, 128]
    assert linear_range(16, 128, 512) == [16, 32, 64, 128, 256, 384, 512]
    # The ramp stops below step (no 48), the linear part is aligned on step, max appended.
    assert linear_range(3, 32, 100) == [3, 6, 12, 24, 32, 64, 96, 100]
    # min_value above step: min kept, then the next multiples of step.
    assert linear_range(200, 128, 512) == [200, 256, 384, 512]
    assert linear_range(5, 5, 5) == [5]


def test_exponential_range_examples():
    # n = ceil(log2 32) + 1 = 6, v_i = 32 ** (i/5) = 2 ** i. Floats give 32 ** 0.8 ==
    # 16.000000000000004, which a naive ceil would turn into 17.
    assert exponential_range(1, 1, 32) == [1, 2, 4, 8, 16, 32]
    # n = 8, v_i = 2 ** i rounded up to multiples of 32: 1, 32 x5, 64, 128.
    assert exponential_range(1, 32, 128) == [1, 32, 64, 128]
    # n = 10, v_i = 16 * 32 ** (i/9) = 16, 23.5, 34.6, 50.8, 74.7, 109.7, 161.3, 237.0,
    # 348.3, 512 -> multiples of 128: 128 x5, 256, 256, 384.
    assert exponential_range(16, 128, 512) == [16, 128, 256, 384, 512]
    # count=4: 1000 ** (1/3) is 9.999999999999998 in floats; exactly 10.
    assert exponential_range(1, 1, 1000, count=4) == [1, 10, 100, 1000]
    assert exponential_range(7, 128, 7) == [7]


range_args = st.tuples(st.integers(1, 4096), st.integers(1, 512), st.integers(0, 20000)).map(
    lambda t: (t[0], t[1], t[0] + t[2])
)


def check_range(values, lo, hi):
    assert values[0] == lo and values[-1] == hi
    assert all(a < b for a, b in zip(values, values[1:])), "strictly increasing"
    assert all(lo <= v <= hi for v in values)


@FAST
@given(range_args)
def test_linear_range_properties(args):
    lo, step, hi = args
    values = linear_range(lo, step, hi)
    check_range(values, lo, hi)
    for a, b in zip(values, values[1:]):
        # Padding bound: doubling below step, at most one step above it.
        assert b - a <= max(a, step)
    for v in values[1:-1]:
        assert v % step == 0 or (v < step and (v // lo) & (v // lo - 1) == 0 and v % lo == 0)


@FAST
@given(range_args, st.one_of(st.none(), st.integers(2, 40)))
def test_exponential_range_properties(args, count):
    lo, step, hi = args
    values = exponential_range(lo, step, hi, count)
    check_range(values, lo, hi)
    n = count if count is not None else max(2, (hi - 1).bit_length() + 1)
    assert len(values) <= n
    assert all(v % step == 0 for v in values[1:-1]), "inner points are multiples of step"


def exact_point(lo, step, hi, i, n_minus_1):
    """Smallest multiple of step >= lo * (hi/lo) ** (i/n_minus_1), by integer bisection."""

    def covers(c):
        return c**n_minus_1 * lo**i >= hi**i * lo**n_minus_1

    k_lo, k_hi = 1, -(-hi // step)  # k_hi * step >= hi >= the point
    while k_lo < k_hi:
        mid = (k_lo + k_hi) // 2
        k_lo, k_hi = (k_lo, mid) if covers(mid * step) else (mid + 1, k_hi)
    return min(k_lo * step, hi)


@FAST
@given(range_args, st.one_of(st.none(), st.integers(2, 40)))
def test_exponential_range_matches_exact_formula(args, count):
    lo, step, hi = args
    if lo == hi:
        assert exponential_range(lo, step, hi, count) == [hi]
        return
    n = count if count is not None else max(2, (hi - 1).bit_length() + 1)
    expected = {lo, hi} | {exact_point(lo, step, hi, i, n - 1) for i in range(1, n - 1)}
    assert exponential_range(lo, step, hi, count) == sorted(expected)


@pytest.mark.parametrize("fn", [linear_range, exponential_range])
@pytest.mark.parametrize(
    "args, word", [((0, 1, 4), "min_value"), ((1, 0, 4), "step"), ((5, 1, 4), "max_value")]
)
def test_range_rejects_bad_args(fn, args, word):
    with pytest.raises(ValueError, match=word):
        fn(*args)


def test_exponential_rejects_count_one():
    with pytest.raises(ValueError, match="count"):
        exponential_range(1, 1, 8, count=1)


# --------------------------------------------------------------------------- limits

GOOD = dict(
    max_batch_size=8,
    max_input_tokens=512,
    max_total_tokens=1024,
    max_prefill_tokens=2048,
    block_size=128,
    max_kv_blocks=64,
)


@pytest.mark.parametrize("field", list(GOOD))
def test_limits_reject_non_positive(field):
    with pytest.raises(ValueError, match=field):
        BucketLimits(**{**GOOD, field: 0})


def test_limits_reject_bad_relations():
    with pytest.raises(ValueError, match=r"max_input_tokens \(1024\).*max_total_tokens \(1024\)"):
        BucketLimits(**{**GOOD, "max_input_tokens": 1024})
    with pytest.raises(ValueError, match=r"max_input_tokens \(512\).*max_prefill_tokens \(256\)"):
        BucketLimits(**{**GOOD, "max_prefill_tokens": 256})


def test_blocks_per_sequence_rounds_up():
    assert BucketLimits(**GOOD).blocks_per_sequence == 8
    assert BucketLimits(**{**GOOD, "max_total_tokens": 1025}).blocks_per_sequence == 9


def test_unknown_strategy_names_the_known_ones():
    with pytest.raises(ValueError, match="cubic.*exponential, linear"):
        plan_buckets(BucketLimits(**GOOD), "cubic")


def test_bad_steps_rejected():
    with pytest.raises(ValueError, match="decode_block_step"):
        StrategySteps(decode_block_step=0)


# --------------------------------------------------------------------------- plans


@st.composite
def limits_st(draw):
    max_input = draw(st.integers(1, 2048))
    return BucketLimits(
        max_batch_size=draw(st.integers(1, 64)),
        max_input_tokens=max_input,
        max_total_tokens=max_input + draw(st.integers(1, 2048)),
        max_prefill_tokens=max_input * draw(st.integers(1, 8)) + draw(st.integers(0, 300)),
        block_size=draw(st.sampled_from([1, 4, 16, 64, 128, 256])),
        max_kv_blocks=draw(st.integers(1, 3000)),
    )


steps_st = st.builds(StrategySteps, *(st.sampled_from([1, 3, 16, 32, 128]) for _ in range(4)))
plan_inputs = st.tuples(limits_st(), st.sampled_from(sorted(STRATEGIES)), steps_st)


@FAST
@given(plan_inputs)
def test_plan_stays_within_limits(inputs):
    limits, strategy, steps = inputs
    plan = plan_buckets(limits, strategy, steps)
    assert len(set(plan.prefill)) == len(plan.prefill) and len(set(plan.decode)) == len(plan.decode)
    for b in plan.prefill:
        assert b.batch_size <= limits.max_batch_size and b.seq_len <= limits.max_input_tokens
        assert b.tokens <= limits.max_prefill_tokens
    for b in plan.decode:
        assert b.batch_size <= limits.max_batch_size and b.num_blocks <= limits.max_kv_blocks
        # Each row holds 1..blocks_per_sequence blocks, so other block totals are useless.
        assert b.batch_size <= b.num_blocks <= b.batch_size * limits.blocks_per_sequence


@FAST
@given(plan_inputs, st.data())
def test_plan_holds_every_batch_within_limits(inputs, data):
    limits, strategy, steps = inputs
    plan = plan_buckets(limits, strategy, steps)
    budget, bps, kv = limits.max_prefill_tokens, limits.blocks_per_sequence, limits.max_kv_blocks
    # Every prompt fits alone; a batch fits whole when its rounded-up grid shape is within budget.
    for length in range(1, limits.max_input_tokens + 1, max(1, limits.max_input_tokens // 50)):
        assert plan.prefill_bucket(1, length) is not None, length
    n = data.draw(st.integers(1, limits.max_batch_size))
    length = data.draw(st.integers(1, limits.max_input_tokens))
    rows = (
        min(b.batch_size for b in plan.prefill if b.batch_size >= n)
        if n <= plan.max_prefill_batch
        else None
    )
    width = min(b.seq_len for b in plan.prefill if b.seq_len >= length)
    if rows is not None and rows * width <= budget:
        assert plan.prefill_bucket(n, length) is not None, (n, length)
    for n in range(1, min(limits.max_batch_size, kv) + 1):
        assert plan.decode_bucket(n, min(n * bps, kv)) is not None, (n, min(n * bps, kv))
    n = data.draw(st.integers(1, min(limits.max_batch_size, kv)))
    total = data.draw(st.integers(n, min(n * bps, kv)))
    assert plan.decode_bucket(n, total) is not None, (n, total)


def test_exponential_defaults_use_fine_batch_steps():
    limits = BucketLimits(32, 256, 320, 4096, 16, 1000)
    plan = plan_buckets(limits, "exponential")
    assert sorted({b.batch_size for b in plan.prefill}) == [1, 2, 4, 8, 16, 32]
    assert sorted({b.seq_len for b in plan.prefill}) == [16, 32, 48, 64, 96, 128, 192, 256]
    assert PrefillBucket(32, 256) not in plan.prefill  # 8192 tokens: over the budget, split instead


def test_decode_batch_capped_by_kv_blocks():
    # 5 blocks in the cache: batches of up to 5 sequences must still have a bucket even
    # though the batch grid would otherwise jump from 4 to 8.
    limits = BucketLimits(8, 16, 32, 64, 16, 5)
    plan = plan_buckets(limits, "linear", StrategySteps(decode_batch_step=32))
    assert plan.decode_bucket(5, 5) == DecodeBucket(5, 5)
    assert plan.decode_bucket(6, 6) is None
    assert plan.max_decode_batch == 5


@FAST
@given(plan_inputs, st.data())
def test_bucket_choice_is_minimal(inputs, data):
    limits, strategy, steps = inputs
    plan = plan_buckets(limits, strategy, steps)
    n = data.draw(st.integers(1, limits.max_batch_size + 2))
    length = data.draw(st.integers(1, limits.max_input_tokens + 2))
    holding = [b for b in plan.prefill if b.batch_size >= n and b.seq_len >= length]
    chosen = plan.prefill_bucket(n, length)
    if not holding:
        assert chosen is None
    else:
        assert chosen in holding
        assert all((chosen.tokens, chosen.batch_size) <= (b.tokens, b.batch_size) for b in holding)
    rows = data.draw(st.integers(1, limits.max_batch_size + 2))
    total = data.draw(st.integers(1, limits.max_kv_blocks + 2))
    holding = [b for b in plan.decode if b.batch_size >= rows and b.num_blocks >= total]
    chosen = plan.decode_bucket(rows, total)
    if not holding:
        assert chosen is None
    else:
        assert chosen in holding
        assert all(
            (chosen.batch_size, chosen.num_blocks) <= (b.batch_size, b.num_blocks) for b in holding
        )


@FAST
@given(
    st.lists(st.builds(DecodeBucket, st.integers(1, 12), st.integers(1, 40)), max_size=30),
    st.integers(1, 14),
    st.integers(1, 45),
)
def test_decode_choice_over_any_buckets(buckets, rows, total):
    """The indexed lookup picks what a scan of every bucket would, over any set (gaps, duplicates)."""
    plan = BucketPlan(prefill=(), decode=tuple(buckets))
    holding = [b for b in buckets if b.batch_size >= rows and b.num_blocks >= total]
    expected = min(holding, key=lambda b: (b.batch_size, b.num_blocks), default=None)
    assert plan.decode_bucket(rows, total) == expected


def test_prefill_choice_tie_prefers_smaller_batch():
    plan = BucketPlan(prefill=(PrefillBucket(4, 64), PrefillBucket(2, 128)), decode=())
    assert plan.prefill_bucket(1, 10) == PrefillBucket(2, 128)


def test_plan_properties():
    plan = BucketPlan(
        prefill=[PrefillBucket(4, 64), PrefillBucket(2, 128)], decode=[DecodeBucket(3, 9)]
    )
    assert isinstance(plan.prefill, tuple)
    assert (plan.max_prefill_batch, plan.max_prefill_seq_len, plan.max_decode_batch) == (4, 128, 3)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.prefill = ()


# --------------------------------------------------------------------------- splits


@FAST
@given(plan_inputs, st.data())
def test_split_prefill_partitions_into_planned_shapes(inputs, data):
    limits, strategy, steps = inputs
    plan = plan_buckets(limits, strategy, steps)
    seq_lens = data.draw(st.lists(st.integers(1, limits.max_input_tokens), max_size=40))
    groups = plan.split_prefill(seq_lens)
    assert sorted(i for g in groups for i in g) == list(range(len(seq_lens)))
    for g in groups:
        assert g
        bucket = plan.prefill_bucket(len(g), max(seq_lens[i] for i in g))
        assert bucket is not None and bucket in plan.prefill


def test_split_prefill_minimizes_padding():
    # Linear seq buckets 16..512 and batch sizes 1,2,4,8: the greedy "fill the longest bucket"
    # would pad four prompts to 512; splitting 2 + 2 pads to 512 and 128 instead.
    limits = BucketLimits(8, 512, 1024, 2048, 16, 100)
    plan = plan_buckets(
        limits, "linear", StrategySteps(prefill_batch_step=32, prefill_seq_step=128)
    )
    groups = plan.split_prefill([500, 100, 510, 90])
    assert groups == [[0, 2], [1, 3]]
    padded = sum(
        plan.prefill_bucket(len(g), max([500, 100, 510, 90][i] for i in g)).tokens for g in groups
    )
    assert padded == 2 * 512 + 2 * 128


@FAST
@given(st.lists(st.integers(1, 200), min_size=1, max_size=7))
def test_split_prefill_is_optimal_against_brute_force(seq_lens):
    plan = plan_buckets(BucketLimits(4, 200, 400, 400, 16, 100), "exponential")

    def cost(groups):
        return sum(plan.prefill_bucket(len(g), max(seq_lens[i] for i in g)).tokens for g in groups)

    def partitions(items):  # every set partition whose parts fit a bucket
        if not items:
            yield []
            return
        first, rest = items[0], items[1:]
        for mask in range(1 << len(rest)):
            part = [first] + [x for k, x in enumerate(rest) if mask >> k & 1]
            if plan.prefill_bucket(len(part), max(seq_lens[i] for i in part)) is None:
                continue
            others = [x for k, x in enumerate(rest) if not mask >> k & 1]
            for tail in partitions(others):
                yield [part] + tail

    assert cost(plan.split_prefill(seq_lens)) == min(
        cost(p) for p in partitions(list(range(len(seq_lens))))
    )


def test_split_prefill_groups_similar_lengths():
    limits = BucketLimits(4, 1024, 2048, 2048, 128, 100)
    plan = plan_buckets(limits, "linear")
    groups = plan.split_prefill([10, 1000, 12, 990, 11])
    # Batch sizes are 1, 2, 4 and lengths 128, 256, ...: (2, 128) + (1, 128) pads less than (4, 128).
    assert groups == [[1, 3], [2], [0, 4]]


def test_split_prefill_rejects_too_long():
    plan = plan_buckets(BucketLimits(**GOOD))
    with pytest.raises(ValueError, match="513 tokens.*512"):
        plan.split_prefill([5, 513])


@FAST
@given(plan_inputs, st.data())
def test_split_decode_partitions_in_order(inputs, data):
    limits, strategy, steps = inputs
    plan = plan_buckets(limits, strategy, steps)
    one = min(limits.blocks_per_sequence, limits.max_kv_blocks)
    counts = data.draw(st.lists(st.integers(1, one), max_size=40))
    groups = plan.split_decode(counts)
    assert [i for g in groups for i in g] == list(range(len(counts)))
    for g in groups:
        assert g
        bucket = plan.decode_bucket(len(g), sum(counts[i] for i in g))
        assert bucket is not None and bucket in plan.decode


def test_split_decode_rejects_oversized_sequence():
    plan = plan_buckets(BucketLimits(**GOOD))  # 8 blocks per sequence, 64 in the cache
    assert plan.split_decode([8, 8]) == [[0, 1]]
    assert plan.max_decode_blocks == 64
    with pytest.raises(ValueError, match=r"sequence 1 holds 65 KV blocks.*\(64 blocks\)"):
        plan.split_decode([1, 65])
    with pytest.raises(ValueError, match="block count"):
        plan.split_decode([0])


# --------------------------------------------------------------------------- padding stats

records_st = st.lists(
    st.tuples(
        st.sampled_from(["prefill", "decode"]), st.integers(0, 10_000), st.integers(0, 10_000)
    ).map(lambda t: (t[0], min(t[1], t[2]), max(t[1], t[2]))),
    max_size=30,
)


@FAST
@given(records_st)
def test_padding_stats_add_up(records):
    stats = PaddingStats()
    for phase, real, padded in records:
        stats.record(phase, real, padded)
    for phase in ("prefill", "decode"):
        real = sum(r for p, r, _ in records if p == phase)
        padded = sum(q for p, _, q in records if p == phase)
        assert (stats.real(phase), stats.padded(phase)) == (real, padded)
        expected = 1 - real / padded if padded else 0.0
        assert stats.waste(phase) == pytest.approx(expected)
        assert stats.as_dict()[phase] == {
            "real": real,
            "padded": padded,
            "waste": stats.waste(phase),
        }
    assert set(stats.as_dict()) == {"prefill", "decode"}


def test_padding_stats_rejects_bad_records():
    stats = PaddingStats()
    with pytest.raises(ValueError, match=r"real \(5\).*padded \(4\)"):
        stats.record("prefill", 5, 4)
    with pytest.raises(ValueError):
        stats.record("decode", -1, 4)
    with pytest.raises(ValueError, match="prefil.*prefill, decode"):
        stats.record("prefil", 1, 2)
    assert stats.as_dict()["prefill"] == {"real": 0, "padded": 0, "waste": 0.0}


def test_a_device_that_compiles_nothing_gets_a_decode_bucket_for_every_batch_size():
    from engine.buckets.plan import with_every_decode_batch

    plan = BucketPlan(
        (PrefillBucket(1, 16),),
        (DecodeBucket(1, 4), DecodeBucket(4, 8), DecodeBucket(4, 16), DecodeBucket(8, 32)),
    )
    every = with_every_decode_batch(plan, blocks_per_sequence=5)
    assert set(plan.decode) <= set(every.decode) and every.prefill == plan.prefill
    # each capped at what its batch's sequences hold: 2 x 5 = 10 blocks, 3 x 5 = 15
    assert {(b.batch_size, b.num_blocks) for b in set(every.decode) - set(plan.decode)} == {
        (2, 8),
        (2, 10),
        (3, 8),
        (3, 15),
        (5, 25),
        (6, 30),
        (7, 32),
    }
    assert every.decode_bucket(3, 10) == DecodeBucket(3, 15)  # no padded row
    assert plan.decode_bucket(3, 10) == DecodeBucket(4, 16)
