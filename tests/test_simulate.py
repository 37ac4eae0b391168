"""The lazy-graph simulator (engine/devices/simulate/): graphs keyed between mark_steps, host reads
and data-dependent shapes as breaks, float64 refused, strict mode after warmup; and the static
sampler under it."""

from __future__ import annotations

import pytest
import torch

from engine.batch import NextTokenChooserParameters
from engine.devices.simulate.adapter import SimulatedHPUAdapter, simulated_adapter
from engine.devices.simulate.lazy import Float64Error, LazyGraphs, on_device
from engine.errors import UnwarmedShapeError
from engine.runner import first_rows
from engine.sampling import static as static_sampling
from engine.sampling.sampler import choose, new_sampling_state

VOCAB = 32


def _step(graphs: LazyGraphs, rows: int):
    with graphs.tracking():
        x = on_device(torch.ones(rows, VOCAB))
        y = (x * 2).softmax(dim=1)
        graphs.mark_step()
        return y.tolist()


def test_a_new_shape_is_a_compile_and_strict_serving_refuses_it():
    graphs = LazyGraphs(strict=True)
    _step(graphs, 2)
    _step(graphs, 2)
    assert graphs.counts()["graph_compiles_warmup"] == 1  # the same key compiles once
    graphs.serving = True
    _step(graphs, 2)
    with pytest.raises(UnwarmedShapeError, match=r"float32\[3, 32\]"):
        _step(graphs, 3)
    assert graphs.counts()["graph_compiles_serving"] == 0


def test_lenient_serving_counts_compiles():
    graphs = LazyGraphs(strict=False)
    graphs.serving = True
    _step(graphs, 2)
    _step(graphs, 3)
    assert graphs.counts()["graph_compiles_serving"] == 2


def test_host_reads_and_dynamic_shapes_with_a_pending_graph_are_breaks():
    graphs = LazyGraphs(strict=False)
    with graphs.tracking():
        x = on_device(torch.arange(6.0))
        (x + 1).tolist()  # pending: a break
        assert graphs.breaks["warmup"] == 1
        graphs.mark_step()
        x.tolist()  # nothing pending: a plain copy
        assert graphs.breaks["warmup"] == 1
        torch.nonzero(x > 2)
        assert graphs.breaks["warmup"] == 2
        host = torch.arange(3.0)
        (host + 1).tolist()  # host tensors are not the device's
        assert graphs.breaks["warmup"] == 2


def test_float64_on_the_device_is_refused_with_its_caller():
    graphs = LazyGraphs()
    with graphs.tracking():
        x = on_device(torch.ones(3))
        with pytest.raises(Float64Error, match="test_simulate.py"):
            x.double()
        torch.ones(3, dtype=torch.float64)  # on the host: fine
    adapter = SimulatedHPUAdapter()
    with pytest.raises(Float64Error):
        adapter.to_device(torch.ones(2, dtype=torch.float64))


def test_the_simulator_is_cpu_only():
    with pytest.raises(ValueError, match="CPU only"):
        simulated_adapter("hpu", "cuda", None, True)
    with pytest.raises(ValueError, match="only hpu"):
        simulated_adapter("xpu", "cpu", None, True)


def _states(params_list):
    return [new_sampling_state(p, i, 7) for i, p in enumerate(params_list)]


PARAMS = [
    NextTokenChooserParameters(),
    NextTokenChooserParameters(repetition_penalty=1.3, frequency_penalty=0.2, logit_bias={3: 2.0}),
    NextTokenChooserParameters(temperature=0.8, top_k=4, top_p=0.9, seed=5),
]


def _sample(adapter, logits, rows):
    histories = [[1, 2, 3], [3, 3, 4], [5]][: logits.shape[0]]
    with adapter.graphs.tracking():
        return static_sampling.choose_static(
            logits,
            list(range(logits.shape[0])),
            _states(PARAMS[: logits.shape[0]]),
            histories,
            [1] * logits.shape[0],
            [2] * logits.shape[0],
            None,
            rows,
            adapter,
        )


def test_the_static_sampler_compiles_once_per_row_count_and_matches_greedy():
    adapter = SimulatedHPUAdapter()
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0))
    bucket = adapter.to_device(logits)  # a decode bucket's output: 4 rows, the real ones first
    _sample(adapter, first_rows(bucket, 3), 4)
    compiles = adapter.graphs.counts()["graph_compiles_warmup"]
    adapter.graphs.serving = True
    for n in (1, 2, 3):  # any mix of rows and processors: one graph at 4 rows
        choice = _sample(adapter, first_rows(bucket, n), 4)
    assert adapter.graphs.counts()["graph_compiles_warmup"] == compiles
    assert adapter.graphs.counts()["graph_breaks_serving"] == 0
    eager = choose(logits[:1], _states(PARAMS[:1]), [[1, 2, 3]], [1], [2])
    assert choice.token_ids[0] == eager.token_ids[0]
    assert [t for t, _ in choice.top_tokens[0]] == [t for t, _ in eager.top_tokens[0]]


def test_unpadded_sampling_would_be_caught():
    """sampling.choose() runs on the real rows: a batch of another size is a serving compile."""
    graphs = LazyGraphs(strict=True)
    logits = torch.randn(3, VOCAB)
    penalized = _states([PARAMS[1], PARAMS[1]])
    with graphs.tracking():
        choose(on_device(logits[:2].clone()), penalized, [[3, 3], [5]], [1, 1], [0, 0])
        graphs.mark_step()
        graphs.serving = True
        with pytest.raises(UnwarmedShapeError):
            choose(on_device(logits[:1].clone()), penalized[:1], [[3]], [1], [0])
            graphs.mark_step()


def test_the_eager_samplers_float64_draw_would_be_refused():
    """sampling.choose() builds its CDF in float64: right on the CPU, refused on the device."""
    with LazyGraphs().tracking(), pytest.raises(Float64Error, match="_draw"):
        choose(on_device(torch.randn(1, VOCAB)), _states(PARAMS[2:]), [[5]], [1], [0])


def test_repeat_interleave_breaks_only_with_tensor_repeats():
    """An int of repeats fixes the output's shape (LoRA's per-token adapter index); a tensor's
    values decide it."""
    graphs = LazyGraphs(strict=False)
    with graphs.tracking():
        x = on_device(torch.arange(3))
        x.repeat_interleave(2)
        assert graphs.breaks["warmup"] == 0
        x.repeat_interleave(on_device(torch.tensor([1, 2, 3])))
        assert graphs.breaks["warmup"] == 1
