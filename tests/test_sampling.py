"""engine/sampling/sampler.py against the definitions of its processors, each computed again here from scratch."""

import math
import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.batch import NextTokenChooserParameters as Params
from engine.errors import InvalidRequestError
from engine.sampling.sampler import (
    choose,
    is_sampling,
    new_sampling_state,
    process_scores,
    validate_parameters,
)

VOCAB = 50


def state(seed: int = 1234, **params):
    return new_sampling_state(Params(seed=seed, **params), request_id=0)


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0, scale: float = 3.0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def choose_rows(logits, states, histories, top_n=None, allowed=None):
    """choose() with every history taken to be all prompt but its last token."""
    prompt_lens = [max(len(h) - 1, 1) for h in histories]
    return choose(logits, states, histories, prompt_lens, top_n or [0] * len(states), allowed)


# --- greedy ---------------------------------------------------------------------------------------------------------


def test_greedy_rows_take_the_argmax_and_report_log_softmax():
    logits = random_logits(6)
    before = logits.clone()
    choice = choose_rows(logits, [state() for _ in range(6)], [[5, 6]] * 6)
    assert choice.token_ids == logits.argmax(dim=1).tolist()
    expected = torch.log_softmax(logits, dim=1)[torch.arange(6), logits.argmax(dim=1)]
    assert torch.allclose(torch.tensor(choice.logprobs), expected, rtol=0, atol=1e-6)
    assert choice.top_tokens == [[]] * 6
    assert torch.equal(logits, before), "choose must not modify the caller's logits"


def test_temperature_zero_is_greedy_even_with_do_sample_and_warpers():
    params = dict(do_sample=True, temperature=0.0, top_k=2, top_p=0.3)
    assert not is_sampling(Params(**params))
    logits = random_logits(4, seed=3)
    choice = choose_rows(logits, [state(seed=i + 1, **params) for i in range(4)], [[1, 2]] * 4)
    assert choice.token_ids == logits.argmax(dim=1).tolist()
    expected = torch.log_softmax(logits, dim=1).max(dim=1).values  # no warper ran on these rows
    assert torch.allclose(torch.tensor(choice.logprobs), expected, rtol=0, atol=1e-6)


def test_a_non_default_warper_turns_sampling_on_as_in_tgi():
    assert not is_sampling(Params())
    assert all(
        is_sampling(p)
        for p in (
            Params(do_sample=True),
            Params(top_k=3),
            Params(top_p=0.9),
            Params(typical_p=0.9),
            Params(temperature=0.7),
        )
    )


# --- seeds ----------------------------------------------------------------------------------------------------------


def test_a_seed_fixes_the_draws_and_another_seed_changes_them():
    steps = [random_logits(1, seed=100 + i, scale=1.0) for i in range(40)]

    def draws(seed: int) -> list[int]:
        sampler = state(seed=seed, do_sample=True)
        return [choose_rows(logits, [sampler], [[1, 2]]).token_ids[0] for logits in steps]

    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


def test_the_seed_in_use_is_the_requested_one_or_a_fresh_random_one():
    assert state(seed=987654321, do_sample=True).seed == 987654321
    assert state(seed=2**64 - 1, do_sample=True).seed == 2**64 - 1
    assert state(seed=0, do_sample=True).seed == 0  # a seed like any other
    unset = [state(seed=None, do_sample=True) for _ in range(2)]
    assert unset[0].seed != unset[1].seed and all(0 < s.seed < 2**64 for s in unset)
    replay = torch.Generator().manual_seed(unset[0].seed)
    assert torch.equal(torch.rand(3, generator=unset[0].generator), torch.rand(3, generator=replay))


# --- heterogeneity --------------------------------------------------------------------------------------------------

MIXED = [
    Params(),
    Params(do_sample=True, top_k=5),
    Params(top_p=0.8, temperature=0.7),
    Params(do_sample=True, typical_p=0.7),
    Params(repetition_penalty=1.5),
    Params(do_sample=True, top_k=10, repetition_penalty=1.2, frequency_penalty=0.9),
    Params(watermark=True),
    Params(do_sample=True),
    Params(temperature=0.0, top_k=3),
]
MIXED_TOP_N = [0, 3, 1, 5, 2, 0, 4, 1, 2]


def test_each_row_of_a_mixed_batch_gets_what_it_would_get_alone():
    n, steps = len(MIXED), 8
    logits = [random_logits(n, seed=200 + step, scale=2.0) for step in range(steps)]
    batch_states = [
        new_sampling_state(Params(**{**vars(p), "seed": 31 + i}), i) for i, p in enumerate(MIXED)
    ]
    batch_histories = [[3, 4, 3, 9 + i] for i in range(n)]
    batch = []
    for step in range(steps):
        batch.append(choose_rows(logits[step], batch_states, batch_histories, MIXED_TOP_N))
        for i, token in enumerate(batch[-1].token_ids):
            batch_histories[i].append(token)
    for i, params in enumerate(MIXED):
        alone_state, history = (
            new_sampling_state(Params(**{**vars(params), "seed": 31 + i}), i),
            [3, 4, 3, 9 + i],
        )
        for step in range(steps):
            alone = choose_rows(logits[step][i : i + 1], [alone_state], [history], [MIXED_TOP_N[i]])
            history.append(alone.token_ids[0])
            assert alone.token_ids[0] == batch[step].token_ids[i], f"row {i} ({params}) step {step}"
            assert alone.logprobs[0] == pytest.approx(batch[step].logprobs[i], abs=1e-5)
            alone_top, batch_top = alone.top_tokens[0], batch[step].top_tokens[i]
            assert [t for t, _ in alone_top] == [t for t, _ in batch_top]
            assert [v for _, v in alone_top] == pytest.approx([v for _, v in batch_top], abs=1e-5)
    sampled = [len(set(h[4:])) > 1 for h in batch_histories]
    assert sampled[1] and sampled[7], "sampling rows should not repeat one token for 8 steps"


# --- warpers: support and distribution ------------------------------------------------------------------------------

TIE = 1e-4  # how close two float64 values must be to count as a possible tie in float32


def reference_support(logits, kind, value, temperature, allowed):
    """(must, may): the tokens the warper has to keep and the tokens it may keep, computed from the definition.

    top_k: keep a token when fewer than k tokens score strictly higher. top_p: rank by probability; keep a token while
    the mass ranked strictly ahead of it is below p. typical_p: the same, ranked by |surprise - entropy|. "may" counts
    near-ties as behind and "must" counts them as ahead, so float32 rounding cannot fail the test.
    """
    allowed = torch.tensor(allowed)
    if (
        kind == "top_k"
    ):  # the definition needs no rounding slack: redo the float32 arithmetic exactly
        scaled = torch.tensor(logits, dtype=torch.float32) / torch.tensor(
            temperature, dtype=torch.float32
        )
        scaled = scaled.masked_fill(~allowed, -math.inf)
        higher = (scaled.unsqueeze(0) > scaled.unsqueeze(1)).sum(dim=1)
        keep = (higher < value) & allowed
        return keep, keep
    scaled = (torch.tensor(logits, dtype=torch.float64) / temperature).masked_fill(
        ~allowed, -math.inf
    )
    p = torch.softmax(scaled, dim=0)
    if kind == "top_p":
        rank_key = -p
    else:
        entropy = -sum(q * math.log(q) for q in p.tolist() if q > 0)
        rank_key = (-torch.log(p) - entropy).abs()
    ahead_surely = ((rank_key.unsqueeze(0) < rank_key.unsqueeze(1) - TIE) * p.unsqueeze(0)).sum(
        dim=1
    )
    ahead_maybe = ((rank_key.unsqueeze(0) <= rank_key.unsqueeze(1) + TIE) * p.unsqueeze(0)).sum(
        dim=1
    ) - p
    return allowed & (ahead_maybe < value - TIE), allowed & (ahead_surely < value + TIE)


@st.composite
def warped_rows(draw):
    vocab = draw(st.integers(2, 24))
    logits = draw(st.lists(st.floats(-6, 6, width=32), min_size=vocab, max_size=vocab))
    kind = draw(st.sampled_from(["top_k", "top_p", "typical_p"]))
    value = draw(st.integers(1, vocab + 2) if kind == "top_k" else st.floats(0.05, 0.95))
    temperature = draw(st.floats(0.5, 2.0))
    allowed = draw(st.lists(st.booleans(), min_size=vocab, max_size=vocab).filter(any))
    return logits, kind, value, temperature, allowed


@settings(max_examples=60, deadline=None)
@given(warped_rows())
def test_warpers_never_emit_a_token_their_definition_excludes(case):
    logits, kind, value, temperature, allowed = case
    draws = 200
    params = {kind: value, "temperature": temperature, "do_sample": True}
    states = [state(seed=s + 1, **params) for s in range(draws)]
    batch_logits = torch.tensor([logits], dtype=torch.float32).repeat(draws, 1)
    mask = torch.tensor([allowed]).repeat(draws, 1)
    must, may = reference_support(logits, kind, value, temperature, allowed)

    kept = torch.isfinite(process_scores(batch_logits[:1], states[:1], [[0]], mask[:1])[0])
    assert not (kept & ~may).any(), (
        f"kept {kept.nonzero().flatten().tolist()}, may keep {may.nonzero().flatten().tolist()}"
    )
    assert not (must & ~kept).any(), (
        f"kept {kept.nonzero().flatten().tolist()}, must keep {must.nonzero().flatten().tolist()}"
    )
    drawn = set(choose_rows(batch_logits, states, [[0, 0]] * draws, allowed=mask).token_ids)
    assert drawn <= set(may.nonzero().flatten().tolist())


def kept_tokens(probs: list[float], **params) -> list[int]:
    logits = torch.tensor([[math.log(q) for q in probs]])
    scores = process_scores(logits, [state(do_sample=True, **params)], [[0]])
    return torch.isfinite(scores[0]).nonzero().flatten().tolist()


def test_typical_p_can_drop_the_most_likely_token():
    # Entropy of [0.4, 0.15 x 4] is 1.505 nats; surprises are 0.916 (distance 0.589) and 1.897 (distance 0.392), so
    # the four 0.15 tokens rank first and reach 0.5 of the mass (as a tie group) without the 0.4 token.
    assert kept_tokens([0.4, 0.15, 0.15, 0.15, 0.15], typical_p=0.5) == [1, 2, 3, 4]
    assert kept_tokens([0.4, 0.15, 0.15, 0.15, 0.15], typical_p=0.7) == [0, 1, 2, 3, 4]


def test_top_p_keeps_the_smallest_head_reaching_p():
    assert kept_tokens([0.2, 0.5, 0.3], top_p=0.45) == [1]
    assert kept_tokens([0.2, 0.5, 0.3], top_p=0.79) == [1, 2]
    assert kept_tokens([0.2, 0.5, 0.3], top_p=0.81) == [0, 1, 2]


def test_draws_follow_the_warped_distribution():
    logits = [2.0, 1.5, 1.0, 0.2, -1.0, -3.0]
    temperature, top_p, draws = 0.8, 0.9, 6000
    # The distribution by hand: scale, keep the best tokens until their mass reaches top_p, renormalise.
    probs = [math.exp(x / temperature) for x in logits]
    probs = [q / sum(probs) for q in probs]
    kept, mass = [], 0.0
    for token in sorted(range(len(probs)), key=lambda t: -probs[t]):
        if mass < top_p:
            kept.append(token)
            mass += probs[token]
    expected = [probs[t] / mass if t in kept else 0.0 for t in range(len(probs))]

    seeds = random.Random(0)
    states = [
        state(seed=seeds.getrandbits(64) or 1, temperature=temperature, top_p=top_p)
        for _ in range(draws)
    ]
    tokens = choose_rows(
        torch.tensor([logits]).repeat(draws, 1), states, [[0, 0]] * draws
    ).token_ids
    observed = [tokens.count(t) / draws for t in range(len(logits))]
    assert all(observed[t] == 0 for t in range(len(logits)) if expected[t] == 0)
    assert max(abs(o - e) for o, e in zip(observed, expected)) < 0.025, (observed, expected)


# --- penalties and watermark ----------------------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_scores_of_every_seen_token():
    logits = torch.tensor([[2.0, -1.0, 0.5, -3.0, 4.0, 0.0, 1.0, -0.5]] * 2)
    history = [0, 1, 1, 5, 3]  # prompt [0, 1], generated [1, 5, 3]: prompt tokens count too
    scores = process_scores(logits, [state(repetition_penalty=2.0), state()], [history, history])
    assert scores[0].tolist() == [2.0 / 2, -1.0 * 2, 0.5, -3.0 * 2, 4.0, 0.0 / 2, 1.0, -0.5]
    assert torch.equal(scores[1], logits[1]), "a row without a penalty keeps its logits"


def test_frequency_penalty_subtracts_penalty_times_share_of_the_history():
    logits = random_logits(2, vocab=8, seed=5)
    history = [2, 2, 7, 2, 4, 7]  # prompt [2, 2, 7], generated [2, 4, 7]
    scores = process_scores(
        logits, [state(frequency_penalty=0.5), state(frequency_penalty=-1.5)], [history] * 2
    )
    for row, penalty in enumerate((0.5, -1.5)):
        expected = [
            logits[row, t].item() - penalty * history.count(t) / len(history) for t in range(8)
        ]
        assert scores[row].tolist() == pytest.approx(expected, abs=1e-6)


def test_repetition_penalty_applies_before_frequency_penalty():
    logits = torch.tensor([[1.0, -2.0, 3.0]])
    history = [0, 0, 1, 2]
    scores = process_scores(
        logits, [state(repetition_penalty=2.0, frequency_penalty=1.0)], [history]
    )
    expected = [1.0 / 2 - 1.0 * 2 / 4, -2.0 * 2 - 1.0 * 1 / 4, 3.0 / 2 - 1.0 * 1 / 4]
    assert scores[0].tolist() == pytest.approx(expected, abs=1e-6)


def test_watermark_adds_delta_to_exactly_the_green_list_of_the_previous_token():
    vocab = 40
    logits = random_logits(3, vocab=vocab, seed=9)
    histories = [[3, 9], [3, 11], [3, 9]]
    scores = process_scores(
        logits, [state(watermark=True), state(watermark=True), state()], histories
    )
    greens = []
    for row, previous in enumerate((9, 11)):
        # Kirchenbauer et al. as TGI runs it: gamma 0.5, delta 2.0, randperm seeded with 15485863 * previous token.
        green = torch.randperm(vocab, generator=torch.Generator().manual_seed(15485863 * previous))[
            : vocab // 2
        ]
        expected = logits[row].clone()
        expected[green] += 2.0
        assert torch.equal(scores[row], expected)
        greens.append(set(green.tolist()))
    assert greens[0] != greens[1]
    assert torch.equal(scores[2], logits[2])


# --- grammar mask, top tokens ---------------------------------------------------------------------------------------


def test_disallowed_tokens_are_never_chosen_and_carry_no_probability():
    rows = [
        Params(),
        Params(do_sample=True),
        Params(top_k=3),
        Params(top_p=0.5),
        Params(repetition_penalty=1.3),
    ]
    states = [
        new_sampling_state(Params(**{**vars(p), "seed": 5 + i}), i) for i, p in enumerate(rows)
    ]
    masks = torch.Generator().manual_seed(11)
    for step in range(20):
        allowed = torch.rand(len(rows), VOCAB, generator=masks) < 0.3
        allowed[:, step] = True
        logits = random_logits(len(rows), seed=300 + step).masked_fill(
            ~allowed, 10.0
        )  # forbidden tokens lead
        choice = choose_rows(logits, states, [[1, 2, 3]] * len(rows), [4] * len(rows), allowed)
        for i, token in enumerate(choice.token_ids):
            assert allowed[i, token]
            assert all(allowed[i, t] for t, _ in choice.top_tokens[i])
        greedy_expected = torch.log_softmax(logits[0].masked_fill(~allowed[0], -math.inf), dim=0)
        assert choice.token_ids[0] == greedy_expected.argmax().item()
        assert choice.logprobs[0] == pytest.approx(greedy_expected.max().item(), abs=1e-6)


def test_a_row_whose_grammar_allows_nothing_is_an_error():
    allowed = torch.ones(2, VOCAB, dtype=torch.bool)
    allowed[1] = False
    with pytest.raises(ValueError, match="allows no token"):
        choose_rows(random_logits(2), [state(), state()], [[1, 2]] * 2, allowed=allowed)


def test_top_tokens_include_ties_with_the_nth_and_skip_excluded_tokens():
    logits = torch.tensor(
        [[1.0, 3.0, 3.0, 0.5, 2.0], [1.0, 3.0, 3.0, 0.5, 2.0], [4.0, 3.0, 2.0, 1.0, 0.0]]
    )
    states = [state(), state(), state(top_k=2)]
    choice = choose_rows(logits, states, [[0, 0]] * 3, top_n=[1, 0, 10])
    log_probs = torch.log_softmax(logits[0], dim=0)
    assert [t for t, _ in choice.top_tokens[0]] == [1, 2]
    assert [v for _, v in choice.top_tokens[0]] == pytest.approx(
        [log_probs[1].item()] * 2, abs=1e-6
    )
    assert choice.top_tokens[1] == []
    assert [t for t, _ in choice.top_tokens[2]] == [0, 1]  # top_k removed the rest: no -inf entries


# --- validation -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("typical_p", 0.0),
        ("typical_p", 1.01),
        ("top_k", -1),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", math.nan),
        ("frequency_penalty", math.nan),
        ("frequency_penalty", -math.inf),
        ("seed", -1),
        ("seed", 2**64),
    ],
)
def test_validation_names_the_bad_field(field, value):
    with pytest.raises(
        InvalidRequestError, match=rf"^request 3: parameters\.{field} must be .*, got {value}$"
    ):
        validate_parameters(3, Params(**{field: value}))
    with pytest.raises(InvalidRequestError, match=rf"parameters\.{field}"):
        new_sampling_state(Params(**{field: value}), 3)


@pytest.mark.parametrize(
    "params",
    [
        Params(),
        Params(temperature=0.0),
        Params(top_p=1.0, typical_p=1.0),
        Params(top_k=100000),
        Params(
            do_sample=True,
            temperature=1.7,
            top_p=0.01,
            typical_p=0.5,
            repetition_penalty=0.5,
            frequency_penalty=-2.0,
        ),
    ],
)
def test_validation_accepts_the_defaults_and_the_edges(params):
    validate_parameters(3, params)


def test_mismatched_batch_arguments_are_reported():
    with pytest.raises(ValueError, match="rows of logits"):
        choose(random_logits(2), [state()], [[1]], [1], [0])
    with pytest.raises(ValueError, match="must start with the prompt"):
        choose(random_logits(1), [state()], [[1]], [2], [0])
