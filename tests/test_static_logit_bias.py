"""The static sampler's logit bias is a sparse [rows, MAX_LOGIT_BIAS] pair of ids and values added
on the device, and the watermark a [rows, vocab] bool green mask
(engine/sampling/static.py): the scores equal the dense host path's (choose()), the
inputs' shapes never depend on the request, so under `--simulate hpu` biases of any size compile
nothing after warmup, and more entries than the cap are refused on both sides of the wire."""

from __future__ import annotations

import pytest
import torch

from engine.batch import NextTokenChooserParameters
from engine.devices.simulate.adapter import SimulatedHPUAdapter
from engine.errors import InvalidRequestError
from engine.runner import first_rows
from engine.sampling.sampler import choose, new_sampling_state
from engine.sampling.static import LOGIT_BIAS_WIDTH, choose_static, host_inputs
from engine.wire.contract import MAX_LOGIT_BIAS
from router.http.validation import Parameters, ValidationError, check_sampling

VOCAB, ROWS = 640, 4  # more ids than the cap, so that a full bias fits the vocabulary
LOGITS = torch.randn(ROWS, VOCAB, generator=torch.Generator().manual_seed(3)) * 2


def _bias(size: int, seed: int) -> dict[int, float]:
    """`size` distinct token ids with biases in [-5, 5) (token 0 among them: padding's id)."""
    generator = torch.Generator().manual_seed(seed)
    ids = [0] + torch.randperm(VOCAB - 1, generator=generator)[: size - 1].add(1).tolist()
    values = (torch.rand(size, generator=generator) * 10 - 5).tolist()
    return dict(zip(ids[:size], values))


BATCHES = [  # every row's entry count differs from batch to batch, up to the cap
    [{}, _bias(1, 1), _bias(37, 2), _bias(MAX_LOGIT_BIAS, 3)],
    [_bias(MAX_LOGIT_BIAS, 4), {}, _bias(5, 5)],
    [_bias(120, 6)],
]


def _params(bias: dict, watermark: bool = False) -> NextTokenChooserParameters:
    return NextTokenChooserParameters(logit_bias=bias, watermark=watermark)


def _both(adapter, batch: list[dict], watermark: list[bool]):
    """The static sampler (on the simulator, the bucket's ROWS rows) and choose() on one batch."""
    n = len(batch)
    params = [_params(b, w) for b, w in zip(batch, watermark)]
    histories = [[7, 11 + i] for i in range(n)]
    states = [new_sampling_state(p, i, 0) for i, p in enumerate(params)]
    bucket = adapter.to_device(LOGITS)  # a decode bucket's output: its real rows first
    with adapter.graphs.tracking():
        static = choose_static(
            first_rows(bucket, n), list(range(n)), states, histories, [1] * n, [3] * n, None,
            ROWS, adapter,
        )  # fmt: skip
    eager = choose(LOGITS[:n], states, histories, [1] * n, [3] * n)
    return static, eager


def _warmed() -> SimulatedHPUAdapter:
    adapter = SimulatedHPUAdapter()
    _both(adapter, [{}], [False])  # warmup: no bias at all
    adapter.graphs.serving = True  # strict: a new graph from here raises
    return adapter


def test_sparse_bias_and_green_mask_equal_the_dense_path_and_compile_nothing():
    adapter = _warmed()
    for number, batch in enumerate(BATCHES):
        watermark = [(i + number) % 2 == 1 for i in range(len(batch))]
        static, eager = _both(adapter, batch, watermark)
        assert static.token_ids == eager.token_ids
        assert static.logprobs == eager.logprobs
        assert static.top_tokens == eager.top_tokens
    counts = adapter.graphs.counts()
    assert counts["graph_compiles_serving"] == 0 and counts["graph_breaks_serving"] == 0


def test_the_inputs_shapes_do_not_depend_on_the_request():
    def shapes(batch: list[dict]) -> list[tuple]:
        states = [new_sampling_state(_params(b, True), i, 0) for i, b in enumerate(batch)]
        histories = [[5, 6]] * len(batch)
        slots = [ROWS] * len(batch)  # the scratch slot
        inputs = host_inputs(states, histories, [0] * len(batch), None, ROWS, VOCAB, slots, ROWS)
        return [(tuple(t.shape), t.dtype) for t in inputs]

    assert LOGIT_BIAS_WIDTH == MAX_LOGIT_BIAS
    expected = shapes([{}])
    assert (ROWS, LOGIT_BIAS_WIDTH) in [shape for shape, _ in expected]
    for batch in BATCHES:
        assert shapes(batch[:1]) == expected


def test_more_entries_than_the_cap_are_refused_naming_the_field():
    too_many = {token: 1.0 for token in range(MAX_LOGIT_BIAS + 1)}
    with pytest.raises(InvalidRequestError, match=r"parameters\.logit_bias must be at most 300"):
        new_sampling_state(_params(too_many), 5)
    new_sampling_state(_params(dict(list(too_many.items())[:-1])), 5)  # the cap itself is fine
    with pytest.raises(ValidationError, match="`logit_bias` may hold at most 300 entries"):
        check_sampling(Parameters(logit_bias=too_many))
