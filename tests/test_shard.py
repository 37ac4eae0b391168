"""The shard's protocol operations on a tiny model: concatenation, filtering, splitting, strictness, bad input."""

import pytest

from engine.batch import Batch, FinishReason
from engine.errors import InvalidRequestError, UnwarmedShapeError
from engine.runner import DecodeInput
from engine.serving.shard import Shard
from launcher.generate import run_requests
from tests.conftest import tiny_config
from tests.helpers import build_request, reference_fixture, shard_fixture
from tests.test_equivalence import PROMPTS

NEW_TOKENS = 20


shard = shard_fixture(max_batch_size=4)
expected = reference_fixture(PROMPTS, NEW_TOKENS)


def request(i, max_new_tokens=NEW_TOKENS, **kw):
    return build_request(i, max_new_tokens, **kw)


def drain(shard, cached, tokens):
    while cached is not None:
        generations, cached = shard.decode([cached])
        for g in generations:
            tokens[g.request_id].append(g.tokens.ids[0])


def test_decode_of_two_concatenated_batches_matches_reference(shard, expected):
    tokens = {i: [] for i in range(4)}
    first, cached_a = shard.prefill(Batch(1, [request(0), request(1)]))
    second, cached_b = shard.prefill(Batch(2, [request(2), request(3, max_new_tokens=5)]))
    for g in first + second:
        tokens[g.request_id].append(g.tokens.ids[0])
    generations, cached = shard.decode([cached_a, cached_b])
    assert cached.id == 1 and cached.request_ids == [0, 1, 2, 3]
    assert set(shard.batches) == {1}  # batch 2 was merged into batch 1
    for g in generations:
        tokens[g.request_id].append(g.tokens.ids[0])
    drain(shard, cached, tokens)
    assert tokens[3] == expected[3][:5]
    assert all(tokens[i] == expected[i] for i in range(3))
    assert shard.allocator.num_free == shard.allocator.num_blocks - 1  # every block came back


def test_finished_requests_leave_the_batch_with_their_reason(shard):
    generations, cached = shard.prefill(
        Batch(3, [request(0, max_new_tokens=1), request(1, max_new_tokens=3)])
    )
    done = {g.request_id: g.generated_text for g in generations}
    assert done[0].finish_reason == FinishReason.LENGTH and done[0].generated_tokens == 1
    assert done[1] is None and cached.request_ids == [1]
    shard.clear()


def test_filter_and_clear_free_blocks(shard):
    free = shard.allocator.num_free
    _, cached = shard.prefill(Batch(4, [request(0), request(1), request(2)]))
    assert shard.allocator.num_free < free
    kept = shard.filter(4, [1])
    assert kept.request_ids == [1] and kept.size == 1
    with pytest.raises(KeyError, match="no request 7"):
        shard.filter(4, [7])
    shard.clear(4)
    assert 4 not in shard.batches and shard.allocator.num_free == free
    with pytest.raises(KeyError, match="batch 4 not found"):
        shard.decode([cached])


def test_batch_larger_than_every_bucket_is_split(tiny_model_dirs, expected):
    shard = Shard(
        tiny_config(tiny_model_dirs["llama"], max_batch_size=2, max_prefill_tokens=128),
        show_progress=False,
    )
    shard.warmup()
    assert shard.runner.plan.max_prefill_batch == 2 and shard.runner.plan.max_decode_batch == 2
    done = run_requests_unbounded(shard, [request(i) for i in range(6)])
    assert [done[i] for i in range(6)] == expected
    assert not shard.adapter.shapes.unwarmed


def run_requests_unbounded(shard, requests):
    """All requests in one prefill, bigger than the warmed batch size (a router may do that)."""
    tokens = {r.id: [] for r in requests}
    generations, cached = shard.prefill(Batch(9, requests))
    for g in generations:
        tokens[g.request_id].append(g.tokens.ids[0])
    drain(shard, cached, tokens)
    return tokens


def test_padding_accounting_adds_up(shard):
    before = shard.runner.padding.as_dict()
    lengths = [len(shard.tokenizer(PROMPTS[i])["input_ids"]) for i in (0, 4)]
    run_requests(shard, [request(0, max_new_tokens=3), request(4, max_new_tokens=3)])
    after = shard.runner.padding.as_dict()
    assert after["prefill"]["real"] - before["prefill"]["real"] == sum(lengths)
    assert after["prefill"]["padded"] - before["prefill"]["padded"] >= sum(lengths)
    assert after["decode"]["real"] - before["decode"]["real"] == 2 + 2  # two rows, two decode steps


def test_strict_mode_refuses_an_unwarmed_shape_and_counts_it(shard):
    row = DecodeInput(token_id=5, position=0, slot=16, blocks=[1])
    plan = shard.runner.plan
    missing = next(
        n
        for n in range(1, 64)
        if plan.decode_bucket(1, n) is not None
        and ("decode", plan.decode_bucket(1, n)) in shard.adapter.shapes.warmed
    )
    bucket = plan.decode_bucket(1, missing)
    shard.adapter.shapes.warmed.discard(("decode", bucket))
    try:
        with pytest.raises(UnwarmedShapeError, match="warmup did not run"):
            shard.runner.decode([row])
        assert shard.adapter.shapes.unwarmed[("decode", bucket)] == 1
    finally:
        shard.adapter.shapes.warmed.add(("decode", bucket))


@pytest.mark.parametrize(
    "bad, message",
    [
        (dict(inputs="word " * 300), "exceeds max_input_tokens=128"),
        (dict(max_new_tokens=0), "max_new_tokens must be at least 1"),
        (dict(max_new_tokens=250), "exceed max_total_tokens=256"),
        # a free block (the running request holds 1), too few for the prompt; decode blocks come on demand
        (dict(blocks=[20], inputs=PROMPTS[4]), r"1 blocks hold fewer than its \d+ prompt tokens"),
    ],
)
def test_bad_request_is_refused_and_the_batch_in_flight_carries_on(shard, expected, bad, message):
    tokens = {0: []}
    generations, cached = shard.prefill(Batch(10, [request(0)]))
    tokens[0].append(generations[0].tokens.ids[0])
    free = shard.allocator.num_free
    req = request(1, max_new_tokens=bad.pop("max_new_tokens", NEW_TOKENS))
    for key, value in bad.items():
        setattr(req, key, value)
    with pytest.raises(InvalidRequestError, match=message):
        shard.prefill(Batch(11, [req]))
    assert shard.allocator.num_free == free and 11 not in shard.batches
    drain(shard, cached, tokens)
    assert tokens[0] == expected[0]
