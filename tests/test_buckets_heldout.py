"""`fitted` on traffic it has not seen: fit on one simulated trace, score on three other seeds.

The traces come from examples/make_shapes.py (the simulation behind the example trace); the plan is
fitted at the default graph budget (the exponential plan's graph count) and compared with the
exponential plan by padding waste, not by time.
"""

from __future__ import annotations

import importlib.util
import sys
from functools import cache
from pathlib import Path

import pytest

from engine.buckets.grid import BucketLimits, plan_buckets
from engine.buckets.plan import make_plan
from engine.buckets.shapes import Shape, count_shapes
from engine.buckets.trace_cost import decode_cost, prefill_cost

MAKE_SHAPES = Path(__file__).resolve().parent.parent / "examples" / "make_shapes.py"
FIT_SEED, HELD_OUT_SEEDS = 0, (1, 2, 3)


@cache
def _simulation():
    spec = importlib.util.spec_from_file_location("make_shapes", MAKE_SHAPES)
    module = importlib.util.module_from_spec(spec)
    sys.modules["make_shapes"] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def trace(seed: int, max_batch_size: int) -> list[Shape]:
    sim = _simulation()
    records = sim.simulate(seed, 8000, sim.Limits(max_batch_size=max_batch_size))
    return [
        Shape(r["phase"], r["batch_size"], r.get("seq_len") or r["num_blocks"]) for r in records
    ]


def limits_for(max_batch_size: int) -> BucketLimits:
    """The limits the simulation runs under (block size 16, 128 blocks per sequence)."""
    return BucketLimits(max_batch_size, 1024, 2048, 4096, 16, max_batch_size * 128)


def waste(plan, limits: BucketLimits, shapes: list[Shape]) -> tuple[int, int]:
    """(padded prefill tokens, padded decode rows) of `plan` on `shapes`."""
    p = prefill_cost(plan, limits, count_shapes(shapes, "prefill"))
    d = decode_cost(plan, limits, count_shapes(shapes, "decode"))
    assert not p.outside and not d.outside
    return p.padded - p.real, d.padded - d.real


def held_out_ratios(fitted, exponential, limits, max_batch_size) -> list[tuple[float, float]]:
    """Per held-out seed: (prefill waste, decode-row waste) of fitted / of exponential."""
    ratios = []
    for seed in HELD_OUT_SEEDS:
        shapes = trace(seed, max_batch_size)
        (fp, fd), (ep, ed) = waste(fitted, limits, shapes), waste(exponential, limits, shapes)
        ratios.append((fp / ep, fd / ed))
    return ratios


@pytest.mark.parametrize("max_batch_size", [32, 64])
def test_fitted_pads_decode_rows_a_third_of_exponential_on_held_out_traces(max_batch_size):
    limits = limits_for(max_batch_size)
    exponential = plan_buckets(limits, "exponential")
    fitted = make_plan("fitted", limits, trace(FIT_SEED, max_batch_size))  # default budget
    assert fitted.graphs <= exponential.graphs
    for prefill_ratio, decode_ratio in held_out_ratios(fitted, exponential, limits, max_batch_size):
        assert decode_ratio <= 1 / 3, (max_batch_size, prefill_ratio, decode_ratio)
        assert prefill_ratio <= 1, (max_batch_size, prefill_ratio, decode_ratio)
