"""The HPU adapter's own decisions, checked against a fake habana_frameworks on CPU."""
import os

import pytest
import torch

from engine.buckets.core import DecodeBucket, PrefillBucket
from engine.devices import get_adapter
from engine.devices.graph_inputs import GraphInputError
from engine.devices.hpu import HPUAdapter
from engine.devices.probe import DeviceError
from engine.distributed import Parallel
from engine.errors import UnwarmedShapeError
from tests.fakes.habana import FakeHabana
from tests.fakes.tiny import PLAN, next_steps, prompts, runner_for, tiny_model

HPU_VARS = ("PT_HPU_LAZY_MODE", "PT_HPU_ENABLE_LAZY_COLLECTIVES", "PT_HPU_RECIPE_CACHE_CONFIG")


@pytest.fixture
def habana(monkeypatch):
    fake = FakeHabana()
    fake.install(monkeypatch)
    monkeypatch.setitem(__import__("sys").modules, "vllm_hpu_extension", None)  # absent: pure torch attention
    monkeypatch.setattr(os, "environ", {k: v for k, v in os.environ.items() if k not in HPU_VARS})
    monkeypatch.setattr(HPUAdapter, "torch_device_type", "cpu")  # the fake runs everything on CPU
    return fake


def hpu(**options) -> HPUAdapter:
    return get_adapter("hpu", **options)


def warmed(adapter, model=None, buckets=None):
    runner = runner_for(model or tiny_model(), adapter)
    for bucket in buckets or (PLAN.prefill + PLAN.decode):
        runner.warm(bucket)
    return runner


def reference_logits():
    """Prefill then one decode step on the CPU adapter: what the HPU path must reproduce."""
    runner = warmed(get_adapter("cpu"))
    return runner.prefill(prompts()).logits, runner.decode(next_steps())


def test_each_warmed_bucket_gets_one_graph_and_serving_replays_it(habana):
    adapter = hpu()
    runner = warmed(adapter)
    assert len(habana.wraps) == 1 and habana.wraps[0][1] == {"disable_tensor_cache": True}
    assert len(habana.captures) == len(PLAN.prefill) + len(PLAN.decode) and not habana.replays
    prefill, decode = runner.prefill(prompts()).logits, runner.decode(next_steps())
    assert len(habana.captures) == 5 and len(habana.replays) == 2 and not habana.bypasses
    assert set(habana.replays) <= habana.graphs
    expected_prefill, expected_decode = reference_logits()
    torch.testing.assert_close(prefill, expected_prefill)
    torch.testing.assert_close(decode, expected_decode)


def test_an_unwarmed_shape_is_bypassed_never_captured(habana):
    lenient = hpu(strict_shapes=False)
    runner = warmed(lenient, buckets=PLAN.prefill + (DecodeBucket(4, 8),))  # (2, 4) is not warmed
    runner.prefill(prompts())
    runner.decode(next_steps())  # 2 rows of 2 blocks: bucket (2, 4)
    assert len(habana.bypasses) == 1 and len(habana.captures) == 3
    assert habana.bypasses[0] not in habana.graphs
    assert lenient.shapes.unwarmed[("decode", DecodeBucket(2, 4))] == 1
    assert lenient.stats[("bypass", "decode")] == 1 and lenient.stats[("replay", "prefill")] == 1

    strict = hpu()
    runner = warmed(strict, buckets=PLAN.prefill)
    with pytest.raises(UnwarmedShapeError):
        runner.decode(next_steps())
    assert len(habana.bypasses) == 1 and len(habana.captures) == 3  # the fake saw nothing more


def test_python_scalars_never_reach_a_graph_input(habana):
    adapter = hpu()
    runner = runner_for(tiny_model(), adapter)
    bucket = PrefillBucket(1, 8)
    ids, positions, meta, last = runner._prefill_tensors(bucket, prompts((5,)))
    for bad in [(ids, positions, meta, 4), (ids, positions, meta._replace(slots=[3, 4]), last)]:
        with pytest.raises(GraphInputError, match=r"graph input inputs(\[3\]|\[2\]\.slots\[0\]) is a Python int"):
            adapter.warm(("prefill", bucket), runner.model, *bad)
    assert not habana.captures and not habana.bypasses  # rejected before the graph cache hashed it
    adapter.warm(("prefill", bucket), runner.model, ids, positions, meta, last)
    assert len(habana.captures) == 1


def traced_forward(habana, monkeypatch, adapter, parallel):
    """Run one warmed decode bucket; the trace interleaves layer ends, collectives and mark_steps."""
    model = tiny_model(parallel)
    for layer in model.layers:
        layer.register_forward_hook(lambda *_: habana.trace.append("layer"))
    import engine.distributed as distributed

    monkeypatch.setattr(distributed.dist, "all_reduce", lambda x, *a, **k: habana.trace.append("all_reduce"))
    monkeypatch.setattr(distributed.dist, "all_gather",
                        lambda parts, x, *a, **k: [p.copy_(x) for p in parts] and habana.trace.append("all_gather"))
    runner = warmed(adapter, model, buckets=(DecodeBucket(2, 4),))
    habana.trace.clear()
    runner.decode(next_steps())
    return habana.trace


@pytest.mark.parametrize("mode", ["graphs", "lazy"])
def test_one_rank_marks_a_step_after_each_layer(habana, monkeypatch, mode):
    trace = traced_forward(habana, monkeypatch, hpu(graph_mode=mode), Parallel(0, 1))
    assert trace == ["mark_step"] + ["layer", "mark_step"] * 3 + ["mark_step"]


@pytest.mark.parametrize("mode", ["graphs", "lazy"])
def test_step_markers_follow_each_layer_and_precede_each_collective(habana, monkeypatch, mode):
    trace = traced_forward(habana, monkeypatch, hpu(graph_mode=mode), Parallel(0, 2))
    assert trace.count("layer") == 3 and "all_reduce" in trace and "all_gather" in trace
    assert trace[0] == trace[-1] == "mark_step"  # input copies and the result stay out of the model's graph
    for i, event in enumerate(trace):
        if event == "layer":
            assert trace[i + 1] == "mark_step", trace
        if event.startswith("all_"):
            assert trace[i - 1] == "mark_step", trace


def test_no_step_markers_in_compile_mode_or_on_other_devices(habana, monkeypatch):
    trace = traced_forward(habana, monkeypatch, get_adapter("cpu"), Parallel(0, 2))
    assert "layer" in trace and "mark_step" not in trace
    monkeypatch.setattr("engine.devices.hpu.compile_static", lambda fn, backend: fn)  # no hpu_backend here
    compiled = hpu(graph_mode="compile")
    assert os.environ["PT_HPU_LAZY_MODE"] == "0" and compiled.step_marker is None
    trace = traced_forward(habana, monkeypatch, compiled, Parallel(0, 2))
    assert "layer" in trace and "mark_step" not in trace and not habana.wraps


def test_environment_backend_and_defaults(habana, tmp_path):
    adapter = hpu(world_size=2, rank=1, cache_dir=tmp_path)
    assert os.environ["PT_HPU_LAZY_MODE"] == "1" and os.environ["PT_HPU_ENABLE_LAZY_COLLECTIVES"] == "1"
    assert os.environ["PT_HPU_RECIPE_CACHE_CONFIG"].startswith(f"{tmp_path / 'hpu_recipes'},False,")
    assert adapter.dist_backend == "hccl" and adapter.default_dtype == torch.bfloat16
    assert adapter.default_block_size == 128 and adapter.graph_mode == "graphs"
    assert adapter.memory_info() == habana.memory and adapter.device_type == "hpu"


def test_single_rank_leaves_collectives_alone_and_a_user_recipe_cache_wins(habana, tmp_path):
    os.environ["PT_HPU_RECIPE_CACHE_CONFIG"] = "/mine,True,100"
    hpu(cache_dir=tmp_path)
    assert "PT_HPU_ENABLE_LAZY_COLLECTIVES" not in os.environ
    assert os.environ["PT_HPU_RECIPE_CACHE_CONFIG"] == "/mine,True,100"


def test_a_lazy_mode_that_contradicts_the_graph_mode_is_refused(habana):
    os.environ["PT_HPU_LAZY_MODE"] = "1"
    with pytest.raises(DeviceError, match="PT_HPU_LAZY_MODE=1 is set: set PT_HPU_LAZY_MODE=0"):
        hpu(graph_mode="compile")


def test_missing_device_names_what_is_missing(habana):
    habana.devices = 0
    with pytest.raises(DeviceError, match=r"--device hpu is not usable here: no Gaudi device is visible"):
        hpu()


def test_vllm_hpu_extension_kernels_serve_attention_when_importable(habana, monkeypatch):
    from engine.buckets.core import BucketPlan
    from tests.fakes.vllm_hpu_extension import FakeExtension

    extension = FakeExtension()
    monkeypatch.delitem(__import__("sys").modules, "vllm_hpu_extension")
    extension.install(monkeypatch)
    adapter = hpu()
    assert adapter.attention_backend.name == "vllm-hpu-extension"
    padded = BucketPlan(prefill=PLAN.prefill, decode=(DecodeBucket(4, 8),))  # 2 padding rows, 4 padding blocks
    runner = runner_for(tiny_model(), adapter, padded)
    for bucket in padded.prefill + padded.decode:
        runner.warm(bucket)
    extension.calls.update(flat_pa=0, prompt_attention=0, fused_sdpa=0)
    prefill, decode = runner.prefill(prompts()).logits, runner.decode(next_steps())
    assert extension.calls == {"flat_pa": 3, "prompt_attention": 3, "fused_sdpa": 3}  # one per layer
    expected_prefill, expected_decode = reference_logits()
    torch.testing.assert_close(prefill, expected_prefill)
    torch.testing.assert_close(decode, expected_decode)
    cpu_runner = warmed(get_adapter("cpu"))
    cpu_runner.decode(next_steps())
    assert extension.calls["flat_pa"] == 3


def test_without_the_extension_attention_is_pure_torch(habana, caplog):
    import engine.devices.hpu_attention as hpu_attention

    hpu_attention._told = False
    with caplog.at_level("INFO", logger="engine.devices.hpu_attention"):
        first, second = hpu(), hpu()
    assert first.attention_backend is None and second.attention_backend is None
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 1 and messages[0].startswith("vllm-hpu-extension is not importable (import of "
                                                         "vllm_hpu_extension halted")
    assert messages[0].endswith("attention runs in pure torch")
