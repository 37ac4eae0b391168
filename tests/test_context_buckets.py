"""The context dimension of prefill buckets: planned for every strategy, fitted within the graph
budget, and carried by recorded shapes."""

import json

import pytest

from engine.buckets.grid import BucketLimits, max_context_blocks
from engine.buckets.plan import make_plan
from engine.buckets.shapes import Shape, parse_shape

LIMITS = BucketLimits(
    max_batch_size=4,
    max_input_tokens=128,
    max_total_tokens=256,
    max_prefill_tokens=256,
    block_size=16,
    max_kv_blocks=64,
)
CHUNKED = BucketLimits(
    max_batch_size=4,
    max_input_tokens=32,
    max_total_tokens=256,
    max_prefill_tokens=32,
    block_size=16,
    max_kv_blocks=64,
    max_prompt_tokens=200,
)


@pytest.mark.parametrize("strategy", ["linear", "exponential", "padding"])
@pytest.mark.parametrize("limits", [LIMITS, CHUNKED])
def test_every_context_within_the_limits_has_a_bucket(strategy, limits):
    plan = make_plan(strategy, limits, prefix_caching=True)
    assert max_context_blocks(limits) == (-(-(199 if limits is CHUNKED else 127) // 16))
    for blocks in range(1, max_context_blocks(limits) + 1):
        for seq in (1, limits.max_input_tokens):
            assert plan.prefill_bucket(1, seq, blocks) is not None, (seq, blocks)
    assert plan.prefill_bucket(1, 1) is not None and plan.prefill_bucket(1, 1).context_blocks == 0
    assert not any(
        b.context_blocks for b in make_plan(strategy, limits).prefill
    )  # off: no context buckets


def test_fitted_plans_recorded_contexts_within_the_graph_budget():
    trace = (
        [Shape("prefill", 2, 40, 3)] * 5
        + [Shape("prefill", 1, 20, 6)] * 3
        + [Shape("prefill", b, s) for b in (1, 2, 3, 4) for s in (10, 30, 50, 70, 90, 110)]
        + [Shape("decode", b, n) for b in (1, 2, 3, 4) for n in (4, 9, 17, 30)]
    )
    assert (
        make_plan("fitted", LIMITS, trace, max_graphs=12).graphs == 12
    )  # the trace fills the budget
    plan = make_plan("fitted", LIMITS, trace, max_graphs=12, prefix_caching=True)
    assert plan.graphs <= 12 and sum(b.context_blocks > 0 for b in plan.prefill) == 3
    assert plan.prefill_bucket(2, 40, 3) is not None and plan.prefill_bucket(1, 20, 6) is not None
    assert (
        plan.prefill_bucket(1, LIMITS.max_input_tokens, max_context_blocks(LIMITS)) is not None
    )  # the cover


def test_recorded_shapes_carry_the_context():
    shape = Shape("prefill", 2, 40, 3)
    assert parse_shape(json.dumps(shape.as_json())) == shape
    assert "context_blocks" not in Shape("prefill", 2, 40).as_json()
    with pytest.raises(ValueError, match="prefill records only"):
        parse_shape('{"phase": "decode", "batch_size": 1, "num_blocks": 2, "context_blocks": 1}')
    with pytest.raises(ValueError, match="non-negative integer 'context_blocks'"):
        parse_shape('{"phase": "prefill", "batch_size": 1, "seq_len": 2, "context_blocks": -1}')


def test_progressive_warmups_covering_set_runs_every_context():
    from engine.warmup.progressive import covering_set

    plan = make_plan("exponential", CHUNKED, prefix_caching=True)
    covering = plan.subset(covering_set(plan, CHUNKED))
    for blocks in range(1, max_context_blocks(CHUNKED) + 1):
        assert covering.split_context([(CHUNKED.max_input_tokens, blocks), (1, 1)])
