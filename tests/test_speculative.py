"""Speculative decoding (engine/spec/): n-gram proposals verified in warmed verify buckets give the
tokens plain decoding gives, greedy and seeded alike, and every emitted token exactly once."""

import pytest

from engine.batch import Batch, NextTokenChooserParameters
from engine.spec.ngram import NgramIndex
from tests.helpers import build_request, shard_fixture

NEW = 40  # crosses block boundaries (blocks of 16)
K = 4
SEEDED = NextTokenChooserParameters(temperature=0.9, top_k=20, do_sample=True, seed=1234)

plain = shard_fixture(max_batch_size=4)
speculating = shard_fixture(max_batch_size=4, speculate="ngram", num_speculative_tokens=K)


def run(shard, requests) -> dict[int, list[int]]:
    """Prefill then decode to the end; request id -> its tokens, as the generations carried them."""
    shard.clear()
    tokens: dict[int, list[int]] = {}
    generations, cached = shard.prefill(Batch(1, requests))
    while True:
        for generation in generations:
            tokens.setdefault(generation.request_id, []).extend(generation.tokens.ids)
            assert len(generation.tokens.texts) == len(generation.tokens.ids)
        if cached is None:
            return tokens
        generations, cached = shard.decode([cached])


def test_ngram_index_proposes_what_followed_the_latest_occurrence():
    index = NgramIndex()
    assert index.propose([1, 2, 3], 4) == []
    assert index.propose([1, 2, 3, 4, 1, 2], 4) == [3, 4, 1, 2]
    assert index.propose([1, 2, 3, 4, 1, 2, 3], 2) == [4, 1]  # grown: indexed incrementally
    assert NgramIndex().propose([5, 1, 9, 5, 2, 5, 1], 3) == [9, 5, 2]  # the longer match wins


@pytest.mark.parametrize("batch", [[4], [0, 1, 4, 5]])
def test_greedy_tokens_equal_plain_decoding(plain, speculating, batch):
    requests = [build_request(i, NEW) for i in batch]
    expected = run(plain, requests)
    before = dict(speculating.speculator.stats)
    got = run(speculating, [build_request(i, NEW) for i in batch])
    assert got == expected
    assert all(len(t) == NEW for t in got.values())
    stats = speculating.speculator.stats
    assert stats["spec_steps"] > before["spec_steps"]
    assert stats["spec_accepted"] > before["spec_accepted"]  # it really skipped forwards
    assert not speculating.adapter.shapes.unwarmed
