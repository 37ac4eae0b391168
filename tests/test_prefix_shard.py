"""Prefill with context on the shard (cache_len): exact against transformers, and refused when wrong."""

import pytest

from engine.batch import Batch
from engine.errors import InvalidRequestError
from engine.kv_cache import slots_for
from tests.helpers import build_request, reference_fixture, shard_fixture

NEW = 6
BLOCK = 16
SHARED = (
    "In 1969 the first humans walked on the moon. The mission was called Apollo 11 and it carried three "
    "astronauts: Neil Armstrong, Buzz Aldrin and Michael Collins, who stayed in orbit"
)
SUFFIXES = [" while the other two landed.", " and then all three came home safely.", " for a day."]


shard = shard_fixture(max_batch_size=4)
expected = reference_fixture([SHARED + s for s in SUFFIXES], NEW)


def length(shard, text):
    return len(shard.tokenizer(text)["input_ids"])


def request(shard, i, blocks, cache_len=0, **kw):
    text = SHARED + SUFFIXES[i]
    slots = slots_for(blocks, 0, length(shard, text), BLOCK)
    return build_request(i, NEW, text, blocks=blocks, slots=slots, cache_len=cache_len, **kw)


def run(shard, batch_id, requests):
    tokens = {r.id: [] for r in requests}
    generations, cached = shard.prefill(Batch(batch_id, requests))
    while True:
        for g in generations:
            tokens[g.request_id].append(g.tokens.ids[0])
        if cached is None:
            return tokens
        generations, cached = shard.decode([cached])


def blocks_for(shard, i, first):
    count = -(-(length(shard, SHARED + SUFFIXES[i]) + NEW) // BLOCK)
    return list(range(first, first + count))


def test_prefix_hits_of_one_and_many_blocks_equal_transformers(shard, expected):
    assert shard.info().use_prefix_caching
    assert any(b.context_blocks for b in shard.runner.plan.prefill)
    owner = blocks_for(shard, 0, 1)
    assert run(shard, 1, [request(shard, 0, owner)])[0] == expected[0]
    shared_blocks = length(shard, SHARED) // BLOCK  # the full blocks of the shared text
    assert shared_blocks >= 2
    for count in (1, shared_blocks):  # exactly one block, and many
        reuse = owner[:count] + blocks_for(shard, 1, 15)[count:]
        assert run(shard, 2, [request(shard, 1, reuse, cache_len=count * BLOCK)])[1] == expected[1]


def test_concurrent_requests_share_prefix_blocks(shard, expected):
    owner = blocks_for(shard, 0, 1)
    run(shard, 3, [request(shard, 0, owner)])
    count = length(shard, SHARED) // BLOCK
    one = owner[:count] + blocks_for(shard, 1, 15)[count:]
    two = owner[:count] + blocks_for(shard, 2, 30)[count:]
    tokens = run(
        shard,
        4,
        [
            request(shard, 1, one, cache_len=count * BLOCK),
            request(shard, 2, two, cache_len=count * BLOCK),
        ],
    )
    assert (tokens[1], tokens[2]) == (expected[1], expected[2])
    assert sum(shard.adapter.shapes.unwarmed.values()) == 0


@pytest.mark.parametrize(
    "cache_len, match",
    [(BLOCK + 1, "whole number of KV blocks"), (10 * BLOCK, "leaves nothing to compute")],
)
def test_bad_cache_len_is_invalid(shard, cache_len, match):
    with pytest.raises(InvalidRequestError, match=match):
        shard.prefill(Batch(5, [request(shard, 0, blocks_for(shard, 0, 1), cache_len=cache_len)]))


def test_prefix_blocks_holding_other_tokens_are_invalid(shard):
    run(shard, 6, [request(shard, 0, blocks_for(shard, 0, 1))])
    stranger = blocks_for(shard, 1, 15)  # never filled with these tokens
    with pytest.raises(InvalidRequestError, match="does not hold this request's tokens"):
        shard.prefill(Batch(7, [request(shard, 1, stranger, cache_len=BLOCK)]))
    lora = request(shard, 1, blocks_for(shard, 0, 1)[:1] + stranger[1:], cache_len=BLOCK)
    lora.adapter_id = (
        "other"  # same tokens, another adapter: another chain (refused as unknown first here)
    )
    with pytest.raises(InvalidRequestError):
        shard.prefill(Batch(8, [lora]))
    assert not shard.batches
