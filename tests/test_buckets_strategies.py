"""Bucket strategies beyond the grids: padding-aware, file, fitted; trace costs; latency-based choice; the CLI."""

from __future__ import annotations

import importlib.util
import itertools
import json
import random
import sys
from collections import Counter
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.buckets.fitted import _layers_1d, fit_plan
from engine.buckets.grid import (
    BucketLimits,
    BucketPlan,
    DecodeBucket,
    PrefillBucket,
    padding_range,
    plan_buckets,
)
from engine.buckets.plan import make_plan, plan_problems
from engine.buckets.shapes import Shape, count_shapes, load_shapes
from engine.buckets.trace_cost import decode_cost, prefill_cost, uniform_prefill_tokens
from engine.cli.main import main

FAST = settings(max_examples=30, deadline=None)
EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "shapes_chat_mixed.jsonl"
EXAMPLE_LIMITS = BucketLimits(
    32, 1024, 2048, 4096, 16, 32 * 128
)  # the limits examples/make_shapes.py simulates
SMALL = BucketLimits(8, 128, 256, 512, 16, 8 * 16)


def random_trace(rng: random.Random, limits: BucketLimits, n: int) -> list[Shape]:
    shapes = []
    for _ in range(n):
        b = rng.randint(1, limits.max_batch_size)
        shapes.append(Shape("prefill", b, rng.randint(1, limits.max_input_tokens)))
        k = rng.randint(b, min(b * limits.blocks_per_sequence, limits.max_kv_blocks))
        shapes.append(Shape("decode", b, k))
    return shapes


@FAST
@given(st.integers(1, 300), st.integers(0, 3000), st.sampled_from([0.1, 0.25, 0.5]))
def test_padding_range_bounds_relative_padding_on_a_fine_grid(lo, extra, bound):
    values = padding_range(lo, 1, lo + extra, bound)
    assert values[0] == lo and values[-1] == lo + extra and values == sorted(set(values))
    for x in range(lo, lo + extra + 1, max(1, extra // 200)):
        bucket = min(v for v in values if v >= x)
        assert (bucket - x) / bucket <= bound, (x, bucket)


def test_padding_strategy_uses_fewer_values_for_looser_bounds():
    assert (
        len(padding_range(1, 1, 1024, 0.5))
        < len(padding_range(1, 1, 1024, 0.25))
        < len(padding_range(1, 1, 1024, 0.1))
    )


@FAST
@given(
    st.lists(st.tuples(st.integers(1, 60), st.integers(1, 5)), min_size=1, max_size=7),
    st.integers(1, 4),
)
def test_one_dimensional_fit_is_optimal_against_brute_force(points, layers):
    weights = Counter()
    for value, weight in points:
        weights[value] += weight
    candidates = sorted(set(weights) | {64})
    results = _layers_1d(weights, candidates, layers)
    for count, (cost, chosen) in enumerate(results, 1):
        assert chosen[-1] == 64 and len(chosen) == count
        padding = sum(w * (min(c for c in chosen if c >= v) - v) for v, w in weights.items())
        assert padding == pytest.approx(cost)
        best = min(
            sum(w * (min(c for c in (*combo, 64) if c >= v) - v) for v, w in weights.items())
            for combo in itertools.combinations(candidates[:-1], count - 1)
        )
        assert cost == pytest.approx(best)


@settings(max_examples=15, deadline=None)
@given(
    st.integers(0, 10**6), st.integers(5, 40)
)  # 5: a prefill bucket, decode batches 1, 2, 4 and 8
def test_fitted_plan_covers_the_limits_within_its_budget(seed, budget):
    rng = random.Random(seed)
    trace = random_trace(rng, SMALL, rng.randint(0, 40))
    if not trace:
        trace = [Shape("prefill", 1, 5)]
    plan = fit_plan(SMALL, trace, budget, 16)
    assert plan.graphs <= budget
    assert plan_problems(plan, SMALL) == []


def test_fitted_budget_below_the_minimum_names_it():
    with pytest.raises(
        ValueError, match="needs at least 5 graphs .* each batch size of 1, 2, 4, 8"
    ):
        make_plan("fitted", SMALL, [Shape("decode", 1, 1)], max_graphs=4)
    with pytest.raises(ValueError, match="needs a trace"):
        make_plan("fitted", SMALL, None)


@pytest.mark.parametrize("strategy", ["linear", "exponential", "padding", "fitted"])
def test_every_plan_has_decode_buckets_for_one_two_and_four_requests(strategy):
    busy = [Shape("decode", b, 3 * b) for b in range(5, 33)]  # a trace without a single small batch
    plan = make_plan(strategy, EXAMPLE_LIMITS, busy + [Shape("prefill", 8, 100)])
    assert {1, 2, 4} <= {b.batch_size for b in plan.decode}
    assert plan.decode_bucket(1, 3).batch_size == 1


def simulated_trace(seed: int) -> list[Shape]:
    """A trace of the example's simulation with another seed: traffic the fit has not seen."""
    spec = importlib.util.spec_from_file_location(
        "make_shapes", EXAMPLE.with_name("make_shapes.py")
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_shapes"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return [
        Shape(r["phase"], r["batch_size"], r.get("seq_len") or r["num_blocks"])
        for r in module.simulate(seed, 8000, module.Limits())
    ]


@pytest.mark.parametrize("block_size", [16, 128])  # the CPU's and HPU's KV block sizes
def test_fitted_prefill_wastes_a_third_of_exponential_on_held_out_traffic(block_size):
    limits = BucketLimits(32, 1024, 2048, 4096, block_size, 32 * 2048 // block_size)
    fitted = make_plan("fitted", limits, load_shapes(EXAMPLE))
    exponential = plan_buckets(limits, "exponential")
    assert fitted.graphs <= exponential.graphs
    held_out = count_shapes(simulated_trace(seed=1), "prefill")
    waste = {}
    for name, plan in (("exponential", exponential), ("fitted", fitted)):
        cost = prefill_cost(plan, limits, held_out)
        assert not cost.outside
        waste[name] = cost.padded - cost.real
    assert 3 * waste["fitted"] <= waste["exponential"], waste


def test_fitted_beats_exponential_by_three_times_on_the_example_trace():
    shapes = load_shapes(EXAMPLE)
    exponential = plan_buckets(EXAMPLE_LIMITS, "exponential")
    fitted = make_plan(
        "fitted", EXAMPLE_LIMITS, shapes
    )  # default budget: the exponential graph count
    assert fitted.graphs <= exponential.graphs
    figures = {}
    for name, plan in (("exponential", exponential), ("fitted", fitted)):
        p = prefill_cost(plan, EXAMPLE_LIMITS, count_shapes(shapes, "prefill"))
        d = decode_cost(plan, EXAMPLE_LIMITS, count_shapes(shapes, "decode"))
        assert not p.outside and not d.outside
        figures[name] = (p.padded - p.real, d.padded - d.real, d.padded_blocks - d.real_blocks)
    for fitted_waste, exponential_waste in zip(figures["fitted"], figures["exponential"]):
        assert 3 * fitted_waste <= exponential_waste, figures


@FAST
@given(
    st.integers(1, 8),
    st.integers(1, 128),
    st.sampled_from(["linear", "exponential", "padding"]),
    st.booleans(),
)
def test_trace_cost_of_prefill_is_the_runners_split(rows, length, strategy, timed):
    plan = plan_buckets(SMALL, strategy)
    if timed:  # a made-up latency that is not proportional to tokens
        plan = BucketPlan(plan.prefill, plan.decode, {b: 1 + b.seq_len**0.5 for b in plan.prefill})
    groups = plan.split_prefill([length] * rows)
    runner_tokens = sum(plan.prefill_bucket(len(g), length).tokens for g in groups)
    assert uniform_prefill_tokens(plan, rows, length) == runner_tokens


def test_latency_decides_bucket_choice_and_splitting():
    small, large = PrefillBucket(2, 64), PrefillBucket(4, 64)
    plan = BucketPlan((small, large), (DecodeBucket(2, 8), DecodeBucket(4, 8)))
    assert plan.prefill_bucket(2, 10) == small  # fewest padded tokens without a profile
    timed = BucketPlan(
        plan.prefill,
        plan.decode,
        {small: 3.0, large: 1.0, DecodeBucket(2, 8): 2.0, DecodeBucket(4, 8): 1.0},
    )
    assert timed.prefill_bucket(2, 10) == large
    assert timed.decode_bucket(1, 3) == DecodeBucket(4, 8)
    assert [len(g) for g in timed.split_prefill([10] * 4)] == [
        4
    ]  # one fast forward, not two slower ones


def test_malformed_shapes_file_names_the_line(tmp_path, capsys):
    trace = tmp_path / "shapes.jsonl"
    trace.write_text(
        '{"phase": "prefill", "batch_size": 2, "seq_len": 10}\n\n{"phase": "decode", "batch_size": 0, "num_blocks": 3}\n'
    )
    assert main(["buckets", "--shapes", str(trace)]) == 2
    assert (
        f"{trace}:3: decode record needs a positive integer 'batch_size', got 0"
        in capsys.readouterr().err
    )
    trace.write_text("not json\n")
    assert main(["buckets", "--shapes", str(trace)]) == 2
    assert f"{trace}:1: not JSON" in capsys.readouterr().err


def test_bucket_file_beyond_the_limits_is_refused(tmp_path, capsys):
    path = tmp_path / "buckets.json"
    path.write_text(
        json.dumps({"prefill_buckets": [[1, 1024], [64, 16]], "decode_buckets": [[32, 4096]]})
    )
    assert main(["buckets", "--strategy", "file", "--bucket-file", str(path)]) == 2
    err = capsys.readouterr().err
    assert "prefill bucket [64, 16] is beyond the limits: batch_size > max_batch_size=32" in err


def test_bucket_file_that_leaves_prompts_uncovered_is_refused(tmp_path, capsys):
    path = tmp_path / "buckets.json"
    path.write_text(json.dumps({"prefill_buckets": [[1, 512]], "decode_buckets": [[32, 4096]]}))
    assert main(["buckets", "--strategy", "file", "--bucket-file", str(path)]) == 2
    assert "no prefill bucket holds a prompt of max_input_tokens=1024" in capsys.readouterr().err


def test_buckets_json_round_trips_through_the_file_strategy(tmp_path, capsys):
    trace = tmp_path / "shapes.jsonl"
    trace.write_text(
        "".join(
            json.dumps(s.as_json()) + "\n"
            for s in random_trace(random.Random(1), EXAMPLE_LIMITS, 50)
        )
    )
    trace.open("a").write('{"phase": "prefill", "batch_size": 40, "seq_len": 10}\n')
    assert (
        main(
            [
                "buckets",
                "--shapes",
                str(trace),
                "--strategy",
                "fitted",
                "--max-graphs",
                "30",
                "--json",
            ]
        )
        == 0
    )
    fitted = json.loads(capsys.readouterr().out)
    assert set(fitted) == {
        "strategy",
        "prefill_buckets",
        "decode_buckets",
        "graphs",
        "prefill",
        "decode",
    }
    assert (
        fitted["graphs"] <= 30 and fitted["prefill"]["outside_limits"] == 1
    )  # batch 40 > 32: reported
    assert {"real", "padded", "waste", "real_blocks", "padded_blocks", "block_waste"} <= set(
        fitted["decode"]
    )
    (tmp_path / "plan.json").write_text(json.dumps(fitted))
    assert (
        main(
            [
                "buckets",
                "--shapes",
                str(trace),
                "--strategy",
                "file",
                "--bucket-file",
                str(tmp_path / "plan.json"),
                "--json",
            ]
        )
        == 0
    )
    again = json.loads(capsys.readouterr().out)
    assert again["prefill"] == fitted["prefill"] and again["decode"] == fitted["decode"]


def test_max_graphs_is_for_fitted_only(capsys):
    assert main(["buckets", "--strategy", "exponential", "--max-graphs", "10"]) == 2
    assert "--max-graphs applies to the fitted strategy only" in capsys.readouterr().err
