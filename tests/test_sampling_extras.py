"""bucketserve's sampling extensions in engine/sampling/sampler.py: OpenAI's presence penalty and logit_bias, vectorized
over a batch where every row keeps its own values (the protocol carries them as extension fields >= 1000)."""

import pytest
import torch

from engine.batch import NextTokenChooserParameters as Params
from engine.errors import InvalidRequestError
from engine.sampling.sampler import choose, new_sampling_state, process_scores

VOCAB = 40


def state(**params):
    return new_sampling_state(Params(seed=7, **params), request_id=0)


def logits(rows: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_presence_penalty_subtracts_once_from_each_generated_token_only():
    scores_in = logits(3)
    history, prompt_len = [5, 9, 9, 5, 12, 12, 12], 3  # prompt [5, 9, 9]; generated [5, 12, 12, 12]
    scores = process_scores(
        scores_in,
        [state(presence_penalty=1.5), state(presence_penalty=-0.5), state()],
        [history] * 3,
        prompt_lens=[prompt_len] * 3,
    )
    for row, penalty in enumerate((1.5, -0.5, 0.0)):
        generated = set(history[prompt_len:])
        expected = [
            scores_in[row, t].item() - (penalty if t in generated else 0.0) for t in range(VOCAB)
        ]
        assert scores[row].tolist() == pytest.approx(expected, abs=1e-6)


def test_logit_bias_minus_100_bans_and_plus_100_forces_per_row():
    scores_in = logits(3, seed=1)
    best = int(scores_in[0].argmax())
    states = [state(logit_bias={best: -100.0}), state(logit_bias={3: 100.0}), state()]
    choice = choose(scores_in, states, [[1, 2]] * 3, [2] * 3, [0] * 3)
    assert choice.token_ids[0] != best and choice.token_ids[1] == 3
    assert choice.token_ids[2] == int(scores_in[2].argmax()), (
        "a row without a bias keeps its argmax"
    )
    for seed in range(20):  # sampling too: +100 wins every draw
        drawn = choose(
            logits(1, seed), [state(logit_bias={7: 100.0}, do_sample=True)], [[1]], [1], [0]
        )
        assert drawn.token_ids == [7]


def test_a_row_gets_the_same_scores_alone_or_in_a_batch():
    scores_in = logits(2, seed=2)
    states = [
        state(presence_penalty=1.0, logit_bias={4: 2.5, 11: -3.0}),
        state(frequency_penalty=0.3),
    ]
    histories = [[1, 4, 4, 11], [2, 3]]
    batch = process_scores(scores_in, states, histories, prompt_lens=[1, 1])
    for row in range(2):
        alone = process_scores(
            scores_in[row : row + 1], [states[row]], [histories[row]], prompt_lens=[1]
        )
        assert torch.equal(batch[row], alone[0])


def test_non_finite_values_are_refused():
    with pytest.raises(InvalidRequestError, match="presence_penalty"):
        state(presence_penalty=float("nan"))
    with pytest.raises(InvalidRequestError, match="logit_bias"):
        state(logit_bias={1: float("inf")})
