import pytest
import torch

from engine.devices import available_devices, get_adapter
from engine.devices.base import ShapeRegistry
from engine.errors import UnwarmedShapeError
from engine.serving.shard import Shard
from launcher.generate import generate
from tests.conftest import tiny_config


def test_unknown_device_lists_the_available_ones():
    with pytest.raises(ValueError, match=r"unknown device 'tpu' \(available: cpu"):
        get_adapter("tpu")


def test_cpu_adapter_facts():
    adapter = get_adapter("cpu")
    assert "cpu" in available_devices()
    assert adapter.torch_device == torch.device("cpu") and adapter.dist_backend == "gloo"
    free, total = adapter.memory_info()
    assert 0 < free <= total
    with pytest.raises(ValueError, match="graph mode 'hpu_graphs' is not available on cpu"):
        get_adapter("cpu", graph_mode="hpu_graphs")


def test_shape_registry_counts_and_enforces():
    lenient, strict = ShapeRegistry(strict=False), ShapeRegistry(strict=True)
    for registry in (lenient, strict):
        registry.mark_warmed(("decode", 1))
        registry.check(("decode", 1))
    lenient.check(("decode", 2))
    lenient.check(("decode", 2))
    assert lenient.unwarmed[("decode", 2)] == 2
    with pytest.raises(UnwarmedShapeError):
        strict.check(("prefill", 3))
    assert strict.unwarmed[("prefill", 3)] == 1


# Limits just above the prompts and tokens below: each bucket of the plan is one inductor compile
# (seconds each), so a plan for the default limits compiled for a minute.
COMPILED_LIMITS = dict(
    max_batch_size=2, max_input_tokens=16, max_total_tokens=32, max_prefill_tokens=32
)


@pytest.mark.slow
def test_compile_mode_gives_the_same_tokens_as_eager(tiny_model_dirs):
    prompts = ["The quick brown fox", "Hi"]
    tokens = {}
    for mode in ("eager", "compile"):
        shard = Shard(
            tiny_config(tiny_model_dirs["mistral"], graph_mode=mode, **COMPILED_LIMITS),
            show_progress=False,
        )
        tokens[mode] = [c.token_ids for c in generate(shard, prompts, 6, ignore_eos=True)]
        assert not shard.adapter.shapes.unwarmed
    assert tokens["compile"] == tokens["eager"]
