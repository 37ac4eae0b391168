"""Compile mode's promise checked by torch itself (engine/devices/dynamo.py): once serving, a call
that would compile is refused under torch's `fail_on_recompile` stance, as strict mode refuses an
unwarmed shape, and dynamo's own counters say what compiled and when. Real inductor on CPU."""

import os

import pytest
import torch

from engine.devices import get_adapter
from engine.devices.simulate.counters import graph_counts, start_serving
from engine.errors import UnwarmedShapeError

SHAPE = ("decode", 4)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Dynamo keeps graphs on the function's code object, whichever test compiled them."""
    torch._dynamo.reset()


def row_sums(x):
    return (x * 2).sum(-1)


def serving_adapter(strict: bool):
    """A compile-mode adapter with one bucket warmed, then serving; and the warmed input."""
    adapter = get_adapter("cpu", graph_mode="compile", strict_shapes=strict)
    warmed = torch.arange(32.0).view(4, 8)
    adapter.warm(SHAPE, row_sums, warmed)
    start_serving(adapter)
    return adapter, warmed


def test_a_guard_that_fails_after_warmup_is_refused_not_compiled():
    adapter, warmed = serving_adapter(strict=True)
    assert torch.equal(adapter.run(SHAPE, row_sums, warmed + 1), row_sums(warmed + 1))
    assert graph_counts(adapter)["graph_recompiles_serving"] == 0
    # the bucket's shape, but strides warmup never saw: dynamo's guard fails, a new graph is due
    transposed = torch.arange(32.0).view(8, 4).t()
    with pytest.raises(UnwarmedShapeError, match=r"would compile a new graph after warmup \(.*"):
        adapter.run(SHAPE, row_sums, transposed)
    counts = graph_counts(adapter)
    assert counts["graph_recompiles_serving"] == 1 and counts["graph_compiles_serving"] == 0
    assert counts["graph_compiles_warmup"] >= 1 and counts["graph_breaks_serving"] == 0
    assert adapter.shapes.unwarmed[SHAPE] == 1


def test_lenient_mode_runs_such_a_call_eagerly_and_counts_it():
    adapter, _ = serving_adapter(strict=False)
    transposed = torch.arange(32.0).view(8, 4).t()
    assert torch.equal(adapter.run(SHAPE, row_sums, transposed), row_sums(transposed))
    counts = graph_counts(adapter)
    assert counts["graph_compiles_serving"] == 0 and counts["graph_recompiles_serving"] == 1
    assert adapter.shapes.unwarmed[SHAPE] == 1


def test_warming_after_serving_began_counts_as_warmup():
    # progressive warmup warms the rest of the plan while the shard serves
    adapter, _ = serving_adapter(strict=True)
    adapter.warm(("decode", 2), row_sums, torch.ones(2, 8))
    counts = graph_counts(adapter)
    assert counts["graph_compiles_serving"] == 0 and counts["graph_recompiles_serving"] == 0


def test_inductors_caches_live_in_the_bucketserve_cache_unless_the_user_chose(
    monkeypatch, tmp_path
):
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    get_adapter("cpu", graph_mode="compile", cache_dir=tmp_path)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", "/mine")
    get_adapter("cpu", graph_mode="compile", cache_dir=tmp_path)
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"] == "/mine"
