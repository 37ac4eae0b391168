"""The CUDA/ROCm adapter's own decisions, on CPU: torch.cuda is faked, and CUDA graphs by a fake
that records the aten ops of a capture and re-runs them on replay (tests/fakes/cuda.py)."""

import pytest
import torch

from engine.buckets.grid import BucketPlan, DecodeBucket
from engine.devices import get_adapter
from engine.devices.cuda.adapter import CUDAAdapter
from engine.devices.graph_inputs import GraphInputError
from engine.devices.probe import DeviceError
from tests.fakes import cuda as fake_cuda
from tests.fakes.cuda import FakeCUDAGraph
from tests.fakes.tiny import PLAN, next_steps, prompts, runner_for, tiny_model


@pytest.fixture
def gpus(monkeypatch):
    calls = fake_cuda.install(monkeypatch, devices=2)
    monkeypatch.setattr(CUDAAdapter, "torch_device_type", "cpu")  # the fake runs everything on CPU
    return calls


def warmed(adapter, model=None, plan=PLAN, buckets=None):
    runner = runner_for(model or tiny_model(), adapter, plan)
    for bucket in buckets or (plan.prefill + plan.decode):
        runner.warm(bucket)
    return runner


def reference(steps=None):
    """Prefill then one decode step on the CPU adapter, eagerly."""
    runner = warmed(get_adapter("cpu"))
    return runner.prefill(prompts()).logits, runner.decode(steps or next_steps())


def test_a_graph_per_decode_bucket_in_one_shared_pool_prefill_eager(gpus):
    adapter = get_adapter("cuda")
    warmed(adapter)
    graphs = FakeCUDAGraph.instances
    assert len(graphs) == len(PLAN.decode) and set(adapter.graphs.captured) == {
        ("decode", b) for b in PLAN.decode
    }
    assert gpus["pool_handles"] == 1 and {g.pool_used for g in graphs} == {("pool", 1)}
    assert adapter.stats[("eager", "prefill")] == len(PLAN.prefill) and not any(
        g.replays for g in graphs
    )


def test_replay_computes_from_the_inputs_copied_into_the_static_buffers(gpus):
    adapter = get_adapter("cuda")
    runner = warmed(adapter)
    prefill, decode = runner.prefill(prompts()).logits, runner.decode(next_steps())
    replayed = adapter.graphs.captured[("decode", DecodeBucket(2, 4))]
    assert replayed.graph.replays == 1 and adapter.stats[("replay", "decode")] == 1
    assert replayed.inputs[0].tolist() == [
        11,
        12,
    ]  # the step's token ids now sit in the static buffer
    expected_prefill, expected_decode = reference()
    torch.testing.assert_close(prefill, expected_prefill)
    torch.testing.assert_close(decode, expected_decode)


@torch.inference_mode()  # as the runner calls the adapter
def test_each_replay_returns_its_own_tensor(gpus):
    adapter = get_adapter("cuda")
    runner = warmed(adapter)
    runner.prefill(prompts())
    first = adapter.run(
        ("decode", DecodeBucket(2, 4)),
        runner.model,
        *runner._decode_tensors(DecodeBucket(2, 4), next_steps()),
    )
    kept = first.clone()
    other = next_steps(tokens=(40, 41))
    adapter.run(
        ("decode", DecodeBucket(2, 4)),
        runner.model,
        *runner._decode_tensors(DecodeBucket(2, 4), other),
    )
    assert torch.equal(
        first, kept
    )  # a batch split over two runs of one bucket keeps its first half


def test_an_unwarmed_decode_shape_runs_eager_and_is_never_replayed(gpus):
    adapter = get_adapter("cuda", strict_shapes=False)
    runner = warmed(adapter, buckets=PLAN.prefill + (DecodeBucket(4, 8),))
    runner.prefill(prompts())
    decode = runner.decode(next_steps())  # bucket (2, 4): never captured
    assert ("decode", DecodeBucket(2, 4)) not in adapter.graphs and adapter.stats[
        ("bypass", "decode")
    ] == 1
    assert sum(g.replays for g in FakeCUDAGraph.instances) == 0
    torch.testing.assert_close(decode, reference()[1])


@torch.inference_mode()
def test_graph_inputs_must_keep_their_captured_layout(gpus):
    adapter = get_adapter("cuda")
    runner = warmed(adapter, plan=BucketPlan(PLAN.prefill, (DecodeBucket(2, 4),)))
    ids, positions, meta, rows = runner._decode_tensors(DecodeBucket(2, 4), next_steps())
    with pytest.raises(GraphInputError, match=r"inputs\[1\] has shape \(3,\), captured \(2,\)"):
        adapter.run(
            ("decode", DecodeBucket(2, 4)), runner.model, ids, torch.tensor([1, 2, 3]), meta, rows
        )
    with pytest.raises(GraphInputError, match=r"inputs\[3\] is a Python int"):
        adapter.run(("decode", DecodeBucket(2, 4)), runner.model, ids, positions, meta, 2)


def test_eager_mode_captures_nothing(gpus):
    adapter = get_adapter("cuda", graph_mode="eager")
    warmed(adapter)
    assert not FakeCUDAGraph.instances and adapter.stats[("eager", "decode")] == len(PLAN.decode)


def test_cuda_facts_and_device_per_rank(gpus):
    adapter = get_adapter("cuda", rank=3, world_size=4)
    assert adapter.device_type == "cuda" and adapter.visibility_var == "CUDA_VISIBLE_DEVICES"
    assert adapter.dist_backend == "nccl" and adapter.default_dtype == torch.bfloat16
    assert (
        adapter.index == 1
        and gpus["set_device"] == [1]
        and adapter.memory_info() == (40 << 30, 80 << 30)
    )


def test_rocm_is_recognised_by_torch_version_hip(monkeypatch):
    fake_cuda.install(monkeypatch, devices=1, hip="6.2.41133")
    adapter = get_adapter("cuda")
    assert adapter.device_type == "rocm" and adapter.visibility_var == "HIP_VISIBLE_DEVICES"
    assert adapter.dist_backend == "nccl"  # RCCL answers to the nccl name


def test_no_visible_gpu_is_one_clear_error(monkeypatch):
    fake_cuda.install(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(
        DeviceError, match=r"^--device cuda is not usable here: no CUDA or ROCm device is visible"
    ):
        get_adapter("cuda")


def test_the_fake_graph_refuses_a_host_sync_during_capture(gpus):
    graph = FakeCUDAGraph()
    x = torch.ones(2)
    with pytest.raises(RuntimeError, match="capturing"):
        with torch.cuda.graph(graph):
            (x * 2).sum().item()


def test_a_new_kv_cache_drops_the_graphs_captured_on_the_old_one(gpus):
    adapter = get_adapter("cuda")
    model = tiny_model()
    warmed(adapter, model)
    assert adapter.graphs.captured
    runner = runner_for(model, adapter)  # a new cache (Shard.warmup again)
    assert not adapter.graphs.captured and not adapter.shapes.warmed
    with pytest.raises(Exception, match="warmup did not run"):
        runner.decode(next_steps())


def test_compile_mode_without_a_c_compiler_is_refused_at_start(gpus, monkeypatch):
    # Finding 11: the CUDA -runtime image has no compiler; torch.compile would fail at the first bucket.
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr("shutil.which", lambda name: None)
    with pytest.raises(
        DeviceError, match=r"--graph-mode compile needs a C compiler .+ \(Dockerfile_cuda's -devel"
    ):
        get_adapter("cuda", graph_mode="compile")
    get_adapter("cuda", graph_mode="graphs")  # needs none


def test_a_second_warmup_frees_the_old_cache_before_sizing_the_new_one(gpus, tiny_model_dirs):
    """The caching allocator keeps a dropped KV cache reserved, and mem_get_info counts it as
    used: without empty_cache (and the model letting go of the cache) a second Warmup RPC in the
    same process sizes its cache from what the old one still holds."""
    from engine.kv_cache import KVCache
    from engine.sampling.penalty_counts import table_bytes
    from tests.helpers import tiny_shard

    shard = tiny_shard(tiny_model_dirs["llama"], warmup=False, device="cuda", graph_mode="eager")
    allocator, config = gpus["allocator"], shard.model_config
    per_block = KVCache.bytes_per_block(
        config.num_layers,
        shard.block_size,
        shard.model.local_kv_heads,
        config.head_dim,
        shard.dtype,
    )
    # Room for about 60 of the 129 blocks the limits could use, after the weights (what loading
    # left cached is handed back first, as a freshly started process would have it) and the
    # sampler's penalty tables.
    allocator.empty_cache()
    tables = table_bytes(shard.config.max_batch_size, config.vocab_size)
    allocator.total = allocator.elsewhere + allocator.reserved + tables + 70 * per_block
    first = shard.warmup().max_supported_total_tokens
    second = shard.warmup().max_supported_total_tokens
    assert first == second and 0 < first < 129 * shard.block_size


def test_rocm_7_with_several_shards_defaults_to_eager(monkeypatch):
    # ROCm/rccl#2022: an all_reduce inside a captured HIP graph fails on ROCm 7.
    fake_cuda.install(monkeypatch, devices=2, hip="7.0.51831")
    assert get_adapter("cuda", world_size=2).graph_mode == "eager"
    assert get_adapter("cuda", world_size=1).graph_mode == "graphs"
    assert get_adapter("cuda", world_size=2, graph_mode="graphs").graph_mode == "graphs"
    fake_cuda.install(monkeypatch, devices=2, hip="6.2.41133")
    assert get_adapter("cuda", world_size=2).graph_mode == "graphs"
