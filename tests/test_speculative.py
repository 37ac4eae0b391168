"""Speculative decoding (engine/speculative/): n-gram proposals verified in warmed verify buckets give the
tokens plain decoding gives, greedy and seeded alike, and every emitted token exactly once."""

import pytest

from engine.batch import Batch, NextTokenChooserParameters
from engine.speculative.ngram import NgramIndex
from tests.helpers import build_request, shard_fixture

NEW = 40  # crosses block boundaries (blocks of 16)
K = 4
WORDS = [" one", " two", " three"]
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


def test_through_the_scheduler_with_preemption_and_the_prefix_cache(speculating, plain):
    """A tiny KV budget (blocks on demand) forces preemptions and resumes; prompts sharing a
    prefix hit the prefix cache; every stream equals plain decoding's, no token lost or repeated."""
    import asyncio

    from engine.batch import Request, StoppingCriteriaParameters
    from engine.config import ServingLimits
    from router.client import InProcessClient
    from router.sched.prefix_cache import PrefixCache
    from router.sched.scheduler import Scheduler
    from tests.helpers import PROMPTS

    limits = ServingLimits(
        max_batch_size=4, max_prefill_tokens=256, max_input_tokens=128, max_total_tokens=256
    )
    prompts = PROMPTS + [PROMPTS[4] + " And then?"]

    def serve(shard):
        shard.clear()

        async def go():
            client = InProcessClient(shard, max_batch_size=4)
            scheduler = Scheduler(client, PrefixCache(14, 16), limits)
            await scheduler.start()
            try:
                streams = []
                for i, prompt in enumerate(prompts):
                    ids = shard.tokenizer(prompt)["input_ids"]
                    stopping = StoppingCriteriaParameters(max_new_tokens=NEW, ignore_eos_token=True)
                    request = Request(i, prompt, stopping_parameters=stopping)
                    streams.append(scheduler.submit(request, len(ids), ids))
                out = []
                for stream in streams:
                    generations = [g async for g in stream]
                    out.append([t for g in generations for t in g.tokens.ids])
            finally:
                await scheduler.stop()
                await client.close()
            return out, scheduler.stats

        return asyncio.run(go())

    expected, _ = serve(plain)
    accepted = speculating.speculator.stats["spec_accepted"]
    got, stats = serve(speculating)
    assert got == expected and stats.preemptions > 0
    assert speculating.speculator.stats["spec_accepted"] > accepted
    assert not speculating.adapter.shapes.unwarmed


def chi2_sf(statistic: float, df: int) -> float:
    """P(X >= statistic) for X ~ chi-square(df) (series of the regularized upper gamma)."""
    import math

    half = statistic / 2
    if df % 2 == 0:
        return math.exp(-half) * sum(half**i / math.factorial(i) for i in range(df // 2))
    total = math.erfc(math.sqrt(half))
    term = math.exp(-half) * math.sqrt(half) / math.gamma(1.5)
    for k in range(1, (df - 1) // 2 + 1):
        total += term
        term *= half / (k + 0.5)
    return total


def test_sampled_tokens_keep_the_targets_distribution(plain, speculating, monkeypatch):
    """The token drawn at a speculated position, over many seeds: speculation (one seed set) and
    plain decoding (another) draw from the same distribution (chi-square, 2 x categories). A logit
    bias (applied at every verified position) puts the mass on the prompt's words, which the
    n-gram proposals offer, so proposals are both accepted and rejected. Adaptive K is off, so
    that every step verifies (four rows accepting one token each would not pay for it)."""
    from collections import Counter

    monkeypatch.setattr(speculating.speculator, "adaptive", False)

    words = [plain.tokenizer(w, add_special_tokens=False)["input_ids"][0] for w in WORDS]
    warm = NextTokenChooserParameters(do_sample=True, logit_bias={token: 40.0 for token in words})
    position, seeds = 7, 160

    def tokens_at(shard, first_seed):
        found = Counter()
        for start in range(first_seed, first_seed + seeds, 4):
            requests = [build_request(i, position + 1, text="".join(WORDS * 6)) for i in range(4)]
            for i, request in enumerate(requests):
                request.parameters = dataclasses_replace(warm, seed=start + i)
            found.update(t[position] for t in run(shard, requests).values())
        return found

    accepted = speculating.speculator.stats["spec_accepted"]
    with_spec, without = tokens_at(speculating, 0), tokens_at(plain, 10_000)
    assert speculating.speculator.stats["spec_accepted"] > accepted + seeds
    common = [t for t in set(with_spec) | set(without) if with_spec[t] + without[t] >= 10]
    table = [
        [c[t] for t in common] + [sum(c.values()) - sum(c[t] for t in common)]
        for c in (with_spec, without)
    ]
    columns = [j for j in range(len(table[0])) if table[0][j] + table[1][j] > 0]
    assert len(columns) >= 2  # a distribution, not one certain token
    total = 2 * seeds
    statistic = 0.0
    for row in table:
        for j in columns:
            expected = sum(row) * (table[0][j] + table[1][j]) / total
            statistic += (row[j] - expected) ** 2 / expected
    assert chi2_sf(statistic, len(columns) - 1) > 0.001


def dataclasses_replace(params, **changes):
    import dataclasses

    return dataclasses.replace(params, **changes)


def test_adaptive_k_follows_the_measured_acceptance():
    from engine.speculative.step import Speculator

    speculator = Speculator("ngram", 8, 4)
    assert speculator.allowed_tokens() == 8  # nothing measured yet: all of K
    for _ in range(10):
        speculator.observe(8, 2, 1)  # two of eight accepted, step after step
    assert speculator.allowed_tokens() == 3  # one more than the accepted length
    for _ in range(20):
        speculator.observe(3, 0, 1)
    assert speculator.allowed_tokens() == 1  # rejected: one proposal a row
    for _ in range(20):
        speculator.observe(1, 1, 1)
    assert speculator.allowed_tokens() == 2 and speculator.summary()["spec_k"] == 2
    speculator.reset_adaptive()
    assert speculator.allowed_tokens() == 8
