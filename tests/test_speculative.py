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


def run_looking_ahead(shard, requests) -> dict[int, list[int]]:
    """As run, with the decode lookahead asked for after every step (async scheduling)."""
    shard.clear()
    tokens: dict[int, list[int]] = {}
    generations, cached = shard.prefill(Batch(1, requests))
    while True:
        for generation in generations:
            tokens.setdefault(generation.request_id, []).extend(generation.tokens.ids)
        if cached is None:
            return tokens
        shard.look_ahead(cached.id)
        generations, cached = shard.decode([cached])


def test_seeded_sampling_and_lookahead_give_the_plain_tokens(plain, speculating):
    def requests():
        return [build_request(0, NEW), build_request(1, NEW, parameters=SEEDED)] + [
            build_request(4, NEW, parameters=SEEDED)
        ]

    expected = run(plain, requests())
    assert run(speculating, requests()) == expected
    assert run_looking_ahead(speculating, requests()) == expected


def test_a_stop_sequence_inside_an_accepted_run_cuts_it_there(plain, speculating):
    greedy = run(plain, [build_request(4, NEW)])[4]
    text = plain.tokenizer.decode(greedy[10:])
    stop = text[len(text) // 2 : len(text) // 2 + 4]  # a stop in the middle of the output

    def outcome(shard):
        shard.clear()
        request = build_request(4, NEW)
        request.stopping_parameters.stop_sequences = [stop]
        generations, cached = shard.prefill(Batch(1, [request]))
        ids = [t for g in generations for t in g.tokens.ids]
        while cached is not None:
            generations, cached = shard.decode([cached])
            ids += [t for g in generations for t in g.tokens.ids]
        return ids, generations[-1].generated_text

    expected = outcome(plain)
    assert expected[1].finish_reason.name == "STOP_SEQUENCE" and len(expected[0]) < NEW
    assert outcome(speculating) == expected


@pytest.mark.parametrize("variant", ["mistral", "qwen2"])
def test_other_architectures_match_transformers(tiny_model_dirs, variant, monkeypatch):
    """Random weights rarely repeat themselves, so an oracle proposes here: the reference tokens,
    every other step with a wrong last one, so that runs are both accepted and cut."""
    from tests.helpers import PROMPTS, reference_tokens, tiny_shard

    shard = tiny_shard(
        tiny_model_dirs[variant], max_batch_size=4, speculate="ngram", num_speculative_tokens=K
    )
    expected = reference_tokens(tiny_model_dirs[variant], PROMPTS[:4], NEW)
    prompts = {tuple(shard.tokenizer(p)["input_ids"]): e for p, e in zip(PROMPTS, expected)}

    def oracle(index, tokens, count):
        prompt = next(p for p in prompts if tuple(tokens[: len(p)]) == p)
        done = len(tokens) - len(prompt)
        proposed = prompts[prompt][done : done + count]
        return proposed[:-1] + [0] if done % 2 and proposed else proposed

    monkeypatch.setattr(NgramIndex, "propose", oracle)
    got = run(shard, [build_request(i, NEW) for i in range(4)])
    assert [got[i] for i in range(4)] == expected
    stats = shard.speculator.stats
    assert 0 < stats["spec_accepted"] < stats["spec_proposed"]
    assert stats["spec_emitted"] > 2 * stats["spec_steps"]
    assert shard.info().speculate == K and not shard.adapter.shapes.unwarmed


@pytest.mark.parametrize("value", ["0", "17"])
def test_a_speculative_width_out_of_range_is_one_error_line(capsys, value):
    from engine.cli.main import build_parser

    with pytest.raises(SystemExit):
        build_parser().parse_args(
            ["serve", "--speculate", "ngram", "--num-speculative-tokens", value]
        )
    assert capsys.readouterr().err.strip().splitlines() == [
        f"error: argument --num-speculative-tokens: must be between 1 and 16, got {value} "
        "(see --help)"
    ]
