"""The speculation off-switch (engine/speculative/step.py's Speculator.tokens_for): while the measured
acceptance does not pay for a verify step the batch decodes plainly, and speculation comes back
when proposals would be accepted again; greedy output stays plain decoding's throughout."""

import pytest

import engine.speculative.ngram as ngram
from engine.speculative.buckets import PROBE_INTERVAL, VERIFY_COST, verify_cost
from engine.speculative.step import Speculator
from tests.helpers import build_request, shard_fixture
from tests.test_speculative import run

NEW = 40
K = 4

plain = shard_fixture(max_batch_size=4)
speculating = shard_fixture(max_batch_size=4, speculate="ngram", num_speculative_tokens=K)


class Oracle:
    """An n-gram stand-in: proposes a token plain decoding never chooses until the row has
    `right_after` tokens of output, then the very tokens plain decoding chooses next."""

    def __init__(self, expected: list[int], right_after: int):
        self.expected, self.right_after = expected, right_after
        self.wrong = next(t for t in range(1, 100) if t not in expected)
        self.prompt_len = None

    def propose(self, tokens: list[int], count: int) -> list[int]:
        if self.prompt_len is None:  # the first decode step: the prefill chose one token
            self.prompt_len = len(tokens) - 1
        generated = len(tokens) - self.prompt_len
        if generated < self.right_after:
            return [self.wrong] * count
        return self.expected[generated : generated + count]


def counted(shard, requests) -> tuple[dict, dict]:
    """run(), and the speculation counters it moved."""
    before = dict(shard.speculator.stats)
    tokens = run(shard, requests)
    return tokens, {k: v - before[k] for k, v in shard.speculator.stats.items()}


def oracle_run(monkeypatch, plain, speculating, right_after: int):
    expected = run(plain, [build_request(0, NEW)])[0]
    oracle = Oracle(expected, right_after)
    monkeypatch.setattr(ngram.NgramIndex, "propose", lambda _, *args: oracle.propose(*args))
    got, moved = counted(speculating, [build_request(0, NEW)])
    return expected, got[0], moved


def test_proposals_always_rejected_switch_speculation_off(monkeypatch, plain, speculating):
    expected, got, moved = oracle_run(monkeypatch, plain, speculating, right_after=NEW)
    assert got == expected
    assert moved["spec_accepted"] == 0
    assert moved["spec_steps"] == 1  # the first verify step measures; every later step is plain
    assert speculating.speculator.summary()["spec_k"] == 0


def test_acceptance_coming_back_turns_speculation_on(monkeypatch, plain, speculating):
    expected, got, moved = oracle_run(monkeypatch, plain, speculating, right_after=NEW // 2)
    assert got == expected
    assert moved["spec_steps"] >= 3  # the first one, then verify steps again in the second half
    # The second half's 20 tokens in few verify steps: proposals of up to K, all accepted.
    assert moved["spec_accepted"] >= NEW // 4
    assert speculating.speculator.summary()["spec_k"] > 0


def test_the_rule_pays_for_a_verify_step_and_draft_proposers_probe():
    speculator = Speculator("draft", K, 4, draft=object())
    assert speculator.tokens_for(1) == K  # nothing measured yet: all of K
    speculator.observe(K, 0, 1)  # nothing accepted: 1 token a row per verify step
    plain_steps = [speculator.tokens_for(1) for _ in range(PROBE_INTERVAL)]
    assert plain_steps == [0] * PROBE_INTERVAL and speculator.summary()["spec_k"] == 0
    assert speculator.tokens_for(1) == K  # the probe, with all of K
    speculator.observe(K, 3, 1)  # accepted again: 0.9 tokens a row on average
    assert speculator.pays(1) and speculator.tokens_for(1) > 0
    assert not speculator.pays(4)  # four rows need more than one accepted token each
    assert verify_cost(3) == VERIFY_COST[4] and verify_cost(1) == VERIFY_COST[1]
    ngram_speculator = Speculator("ngram", K, 4)
    ngram_speculator.observe(K, 0, 1)
    assert [ngram_speculator.tokens_for(1) for _ in range(3 * PROBE_INTERVAL)] == [0] * (
        3 * PROBE_INTERVAL
    )  # n-gram rows never probe: their plain steps measure


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_without_adaptive_k_speculation_stays_on(rows):
    speculator = Speculator("ngram", K, 4, adaptive=False)
    speculator.observe(K, 0, rows)
    assert speculator.tokens_for(rows) == K


def test_a_new_row_measures_afresh():
    speculator = Speculator("ngram", K, 4)
    speculator.meet([1, 2])
    speculator.observe(K, 0, 2)
    assert speculator.tokens_for(2) == 0
    speculator.meet([1])  # a row left: what was measured still holds
    assert speculator.tokens_for(1) == 0
    speculator.meet([1, 3])  # a row joined: its proposals may be accepted
    assert speculator.tokens_for(2) == K
