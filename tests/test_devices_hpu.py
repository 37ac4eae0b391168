"""The HPU adapter's own decisions, checked against a strict fake habana_frameworks on CPU
(tests/fakes/habana.py: graphs keyed by input shapes, static outputs, PT_HPU_LAZY_MODE read at import)."""

import os
import sys

import pytest
import torch

from engine.buckets.grid import DecodeBucket, PrefillBucket
from engine.devices import get_adapter
from engine.devices.cpu.adapter import CPUAdapter
from engine.devices.graph_inputs import GraphInputError
from engine.devices.hpu.adapter import HPUAdapter
from engine.devices.probe import DeviceError
from engine.distributed import Parallel
from engine.errors import UnwarmedShapeError
from tests.fakes.habana import FakeHabana
from tests.fakes.tiny import PLAN, next_steps, prompts, runner_for, tiny_model

HPU_VARS = ("PT_HPU_LAZY_MODE", "PT_HPU_ENABLE_LAZY_COLLECTIVES", "PT_HPU_RECIPE_CACHE_CONFIG")


def start_bridge(monkeypatch, lazy_mode: str | None = "1", **options) -> FakeHabana:
    """The environment a shard starts with, then the bridge's import (which reads it)."""
    environ = {k: v for k, v in os.environ.items() if k not in HPU_VARS}
    if lazy_mode is not None:
        environ["PT_HPU_LAZY_MODE"] = lazy_mode
    monkeypatch.setattr(os, "environ", environ)
    fake = FakeHabana(**options)
    fake.install(monkeypatch)
    return fake


@pytest.fixture
def habana(monkeypatch):
    for name in ("vllm_hpu_extension", "vllm_gaudi"):
        monkeypatch.setitem(sys.modules, name, None)  # absent: pure torch decode attention
    monkeypatch.setattr(HPUAdapter, "torch_device_type", "cpu")  # the fake runs everything on CPU
    return start_bridge(monkeypatch)


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


def test_a_new_kv_cache_drops_the_graphs_captured_on_the_old_one(habana):
    # Finding 2: the wrapper keys graphs by input shapes alone, and the KV cache is a module
    # attribute: a graph replayed after a new cache is bound reads and writes the old one.
    # Here the first cache saw only the prefill buckets (as the memory-profiling run's scratch cache
    # sees the largest one): replayed afterwards, they write the prompts into the old cache, and the
    # decode graph captured on the new cache finds nothing there.
    adapter, model = hpu(), tiny_model()
    warmed(adapter, model, buckets=PLAN.prefill)
    runner = warmed(adapter, model)  # Shard.warmup again: a new cache
    prefill, decode = runner.prefill(prompts()).logits, runner.decode(next_steps())
    expected_prefill, expected_decode = reference_logits()
    torch.testing.assert_close(prefill, expected_prefill)
    torch.testing.assert_close(decode, expected_decode)
    assert len(habana.captures) == len(PLAN.prefill) + len(PLAN.prefill) + len(PLAN.decode)


def test_the_memory_profiling_run_keeps_no_graph(habana):
    from engine.warmup.memory import profile_free_memory
    from tests.fakes.tiny import BLOCK, LIMITS

    adapter = hpu()
    profile_free_memory(tiny_model(), adapter, torch.float32, BLOCK, LIMITS)
    assert not habana.captures and len(habana.bypasses) == 1 and not adapter.shapes.warmed


@torch.inference_mode()  # as the runner calls the adapter
def test_each_replay_returns_its_own_tensor(habana):
    # Finding 3: a replay returns the graph's static output; two groups of one bucket share it.
    adapter = hpu()
    runner = warmed(adapter)
    runner.prefill(prompts())
    bucket = DecodeBucket(2, 4)
    first = adapter.run(
        ("decode", bucket), runner.model, *runner._decode_tensors(bucket, next_steps())
    )
    kept = first.clone()
    adapter.run(
        ("decode", bucket),
        runner.model,
        *runner._decode_tensors(bucket, next_steps(tokens=(40, 41))),
    )
    assert torch.equal(first, kept)


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
    assert (
        len(habana.bypasses) == 1 and len(habana.captures) == 3 + 2
    )  # its own two prefill graphs, no more


def test_python_scalars_never_reach_a_graph_input(habana):
    adapter = hpu()
    runner = runner_for(tiny_model(), adapter)
    bucket = PrefillBucket(1, 8)
    ids, positions, meta, last = runner._prefill_tensors(bucket, prompts((5,)))
    for bad in [(ids, positions, meta, 4), (ids, positions, meta._replace(slots=[3, 4]), last)]:
        with pytest.raises(
            GraphInputError, match=r"graph input inputs(\[3\]|\[2\]\.slots\[0\]) is a Python int"
        ):
            adapter.warm(("prefill", bucket), runner.model, *bad)
    assert not habana.captures and not habana.bypasses  # rejected before the graph cache hashed it
    adapter.warm(("prefill", bucket), runner.model, ids, positions, meta, last)
    assert len(habana.captures) == 1


def traced_forward(habana, monkeypatch, adapter, parallel):
    """Warm one decode bucket (in graphs mode: its capture, the one run where Python executes); the
    trace interleaves layer ends, collectives and mark_steps."""
    model = tiny_model(parallel)
    for layer in model.layers:
        layer.register_forward_hook(lambda *_: habana.trace.append("layer"))
    import engine.distributed as distributed

    monkeypatch.setattr(
        distributed.dist, "all_reduce", lambda x, *a, **k: habana.trace.append("all_reduce")
    )
    monkeypatch.setattr(
        distributed.dist,
        "all_gather",
        lambda parts, x, *a, **k: [p.copy_(x) for p in parts] and habana.trace.append("all_gather"),
    )
    runner = runner_for(model, adapter)
    habana.trace.clear()
    runner.warm(DecodeBucket(2, 4))
    return habana.trace


@pytest.mark.parametrize("mode", ["graphs", "lazy"])
def test_one_rank_marks_a_step_after_each_layer(habana, monkeypatch, mode):
    trace = traced_forward(habana, monkeypatch, hpu(graph_mode=mode), Parallel(0, 1))
    assert trace == ["mark_step"] + ["layer", "mark_step"] * 3 + ["mark_step"]


@pytest.mark.parametrize("mode", ["graphs", "lazy"])
def test_a_step_is_marked_before_every_all_reduce(habana, monkeypatch, mode):
    # With PT_HPU_ENABLE_LAZY_COLLECTIVES=1 (tensor-parallel HPU graphs need it) the bridge crashes
    # on an all_reduce inside a lazy graph: vllm-fork cut the graph before it (commit 1fd06cc5,
    # vllm/distributed/communication_op.py), and vllm-gaudi's HpuCommunicator.all_reduce and TGI's
    # Gaudi backend keep that mark_step.
    trace = traced_forward(habana, monkeypatch, hpu(graph_mode=mode, world_size=2), Parallel(0, 2))
    assert trace.count("layer") == 3 and "all_reduce" in trace and "all_gather" in trace
    before = [trace[i - 1] for i, event in enumerate(trace) if event == "all_reduce"]
    assert before and set(before) == {"mark_step"}


def test_no_step_markers_in_compile_mode_or_on_other_devices(habana, monkeypatch):
    monkeypatch.setattr(
        CPUAdapter, "warm_runs_forward", True
    )  # an eager CPU's warmup runs no forward
    trace = traced_forward(habana, monkeypatch, get_adapter("cpu"), Parallel(0, 2))
    assert "layer" in trace and "mark_step" not in trace
    habana = start_bridge(monkeypatch, lazy_mode="0")
    monkeypatch.setattr(
        "engine.devices.hpu.adapter.compile_static", lambda fn, backend: fn
    )  # no hpu_backend here
    compiled = hpu(graph_mode="compile", world_size=2)
    assert compiled.step_marker is None
    trace = traced_forward(habana, monkeypatch, compiled, Parallel(0, 2))
    assert "layer" in trace and "mark_step" not in trace and not habana.wraps


def test_environment_backend_and_defaults(habana, tmp_path):
    adapter = hpu(world_size=2, rank=1, cache_dir=tmp_path)
    assert os.environ["PT_HPU_ENABLE_LAZY_COLLECTIVES"] == "1"
    assert os.environ["PT_HPU_WEIGHT_SHARING"] == "0"  # as TGI and vllm-gaudi serve
    assert os.environ["PT_HPU_RECIPE_CACHE_CONFIG"].startswith(f"{tmp_path / 'hpu_recipes'},False,")
    assert adapter.dist_backend == "hccl" and adapter.default_dtype == torch.bfloat16
    assert adapter.default_block_size == 128 and adapter.graph_mode == "graphs"
    assert adapter.memory_info() == habana.memory and adapter.device_type == "hpu"


def test_several_ranks_register_hccl_before_joining_the_group(habana):
    # Finding 5: init_process_group("hccl") needs habana_frameworks.torch.distributed.hccl imported.
    hpu(world_size=1)
    assert not habana.hccl_imported
    hpu(world_size=2, rank=1)
    assert habana.hccl_imported


def test_single_rank_leaves_collectives_alone_and_a_user_recipe_cache_wins(habana, tmp_path):
    os.environ["PT_HPU_RECIPE_CACHE_CONFIG"] = "/mine,True,100"
    hpu(cache_dir=tmp_path)
    assert "PT_HPU_ENABLE_LAZY_COLLECTIVES" not in os.environ
    assert os.environ["PT_HPU_RECIPE_CACHE_CONFIG"] == "/mine,True,100"


def test_a_lazy_mode_that_contradicts_the_graph_mode_is_refused(habana):
    with pytest.raises(DeviceError, match="PT_HPU_LAZY_MODE=1 is set: set PT_HPU_LAZY_MODE=0"):
        hpu(graph_mode="compile")


def test_a_bridge_started_in_eager_mode_is_refused_for_graphs(monkeypatch, habana):
    # Finding 6: the bridge reads PT_HPU_LAZY_MODE when torch is imported (unset: eager); setting it
    # afterwards, as the adapter used to, changes nothing.
    start_bridge(monkeypatch, lazy_mode=None)
    with pytest.raises(
        DeviceError,
        match=r"--graph-mode graphs needs the Habana bridge in lazy mode, but the "
        r"Habana bridge started in eager mode: set PT_HPU_LAZY_MODE=1",
    ):
        hpu()


def test_the_launcher_gives_every_hpu_shard_the_same_module_list_and_the_bridge_mode(monkeypatch):
    # Findings 5 and 6: Habana wants one HABANA_VISIBLE_MODULES for all processes (each takes its
    # LOCAL_RANK-th), and PT_HPU_LAZY_MODE in the environment before the shard imports torch.
    # Module ids are the host's (Kubernetes' device plugin hands out any cards): without a list of
    # the user's, none is made up (not 0..N-1), as upstream does; each rank takes its LOCAL_RANK.
    from engine.devices.probe import Probe, resolve_device

    FakeHabana(release="1.22.0").install_metadata(monkeypatch)  # lazy mode is its default
    gaudi = lambda asked: [Probe("hpu", True, count=8)]  # noqa: E731
    plan = resolve_device("hpu", 4, {}, lambda: ["hpu"], probe=gaudi)
    envs = [plan.env(rank) for rank in range(4)]
    assert not any("HABANA_VISIBLE_MODULES" in env for env in envs)
    assert all(
        env["PT_HPU_LAZY_MODE"] == "1" and env["PT_HPU_ENABLE_LAZY_COLLECTIVES"] == "1"
        for env in envs
    )
    narrowed = resolve_device(
        "hpu",
        2,
        {"HABANA_VISIBLE_MODULES": "4,6", "PT_HPU_LAZY_MODE": "1"},
        lambda: ["hpu"],
        probe=gaudi,
    )
    assert narrowed.env(1)[
        "HABANA_VISIBLE_MODULES"
    ] == "4,6" and "PT_HPU_LAZY_MODE" not in narrowed.env(1)


def test_missing_device_names_what_is_missing(habana):
    habana.devices = 0
    with pytest.raises(
        DeviceError, match=r"--device hpu is not usable here: no Gaudi device is visible"
    ):
        hpu()
