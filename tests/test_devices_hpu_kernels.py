"""Gaudi attention kernels (finding 1): every supported vllm-hpu-extension release is called with
its own signature and layout, prefill goes to FusedSDPA, and a fallback to pure torch is a WARNING
that says why. The fakes (tests/fakes/vllm_hpu_extension.py) mirror each release's ops.py."""

import inspect

import pytest
import torch

from engine.buckets.grid import BucketPlan, DecodeBucket, PrefillBucket
from engine.devices import get_adapter
from engine.devices.hpu import attention as hpu_attention
from engine.runner import PrefillInput
from tests.fakes.tiny import CONFIG, PLAN, next_steps, prompts, runner_for, tiny_model
from tests.fakes.vllm_hpu_extension import FakeExtension
from tests.test_devices_hpu import habana, reference_logits, warmed  # noqa: F401 - the fixture

PADDED = BucketPlan(
    prefill=PLAN.prefill, decode=(DecodeBucket(4, 8),)
)  # 2 padding rows, 4 padding blocks


@pytest.fixture(autouse=True)
def fresh_log(monkeypatch):
    monkeypatch.setattr(hpu_attention, "_told", set())


def serve(extension, monkeypatch, habana, graph_mode="lazy"):
    """Lazy mode by default: every forward runs the kernels' Python (a graph replay would not)."""
    extension.install(monkeypatch)
    adapter = get_adapter("hpu", graph_mode=graph_mode)
    runner = runner_for(tiny_model(), adapter, PADDED)
    for bucket in PADDED.prefill + PADDED.decode:
        runner.warm(bucket)
    extension.calls.update(flat_pa=0, prompt_attention=0, fused_sdpa=0)
    extension.fused_lengths.clear()
    return adapter, runner.prefill(prompts()).logits, runner.decode(next_steps())


@pytest.mark.parametrize(
    "version, with_vllm",
    [("v1.21.0", True), ("v1.21.3", False), ("v1.22.0", False), ("vllm-gaudi", True)],
)
def test_each_supported_release_serves_decode_and_fused_sdpa_serves_prefill(
    habana, monkeypatch, version, with_vllm
):
    extension = FakeExtension(version, with_vllm=with_vllm)
    adapter, prefill, decode = serve(extension, monkeypatch, habana)
    layers = CONFIG.num_layers
    assert extension.calls == {"flat_pa": layers, "prompt_attention": 0, "fused_sdpa": layers}
    # FusedSDPA skips the padding: the prompts' real lengths (5 and 7), and 1 for each padding row
    bucket = PADDED.prefill_bucket(len(prompts()), 7)
    assert extension.fused_lengths == [[5, 7] + [1] * (bucket.batch_size - 2)] * layers
    expected_prefill, expected_decode = reference_logits()
    torch.testing.assert_close(prefill, expected_prefill)
    torch.testing.assert_close(decode, expected_decode)
    if version in ("v1.22.0", "vllm-gaudi"):
        assert (
            extension.model_type == "llama" and extension.config_read
        )  # set before the first read
    assert "flat_pa" in adapter.attention_backend.name


def test_the_kernels_replay_correctly_in_hpu_graphs(habana, monkeypatch):
    extension = FakeExtension("v1.22.0")
    _, prefill, decode = serve(extension, monkeypatch, habana, graph_mode="graphs")
    assert extension.calls["flat_pa"] == 0 and habana.replays  # replayed: no Python ran
    expected_prefill, expected_decode = reference_logits()
    torch.testing.assert_close(prefill, expected_prefill)
    torch.testing.assert_close(decode, expected_decode)


def test_v1_21_0_without_vllm_falls_back_with_a_warning_naming_the_reason(
    habana, monkeypatch, caplog
):
    extension = FakeExtension("v1.21.0", with_vllm=False)
    with caplog.at_level("WARNING", logger="engine.devices.hpu.attention"):
        adapter, prefill, decode = serve(extension, monkeypatch, habana)
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert len(warnings) == 1 and warnings[0].startswith(
        "decode attention runs in pure torch: no usable "
        "vllm-hpu-extension (vllm_hpu_extension: No module named 'vllm'"
    )
    assert extension.calls["flat_pa"] == 0 and extension.calls["fused_sdpa"] == CONFIG.num_layers
    torch.testing.assert_close(decode, reference_logits()[1])


def test_a_release_with_an_unknown_required_argument_is_refused(habana, monkeypatch, caplog):
    extension = FakeExtension("v1.21.3")
    original = extension.ops_functions

    def newer():
        functions = original()
        base = functions["flat_pa"]

        def flat_pa(
            query,
            key_cache,
            value_cache,
            block_list,
            block_mapping,
            block_bias,
            block_groups,
            block_size,
            scale,
            matmul_qk_op,
            matmul_av_op,
            batch2block_matmul_op,
            block2batch_matmul_op,
            keys_fetch_func,
            values_fetch_func,
            window_blocks,
            **ignored_args,
        ):
            return base(
                query, key_cache, value_cache, block_list, block_mapping, block_bias, block_groups
            )

        return {**functions, "flat_pa": flat_pa}

    extension.ops_functions = newer
    with caplog.at_level("WARNING", logger="engine.devices.hpu.attention"):
        serve(extension, monkeypatch, habana)
    assert any(
        "its flat_pa requires window_blocks, which this engine does not pass" in r.getMessage()
        for r in caplog.records
    )
    assert extension.calls["flat_pa"] == 0


def test_without_any_kernel_attention_is_pure_torch_and_said_once(habana, caplog):
    with caplog.at_level("WARNING", logger="engine.devices.hpu.attention"):
        first, second = get_adapter("hpu"), get_adapter("hpu")
    assert first.attention_backend is None and second.attention_backend is None
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2 and all(r.levelname == "WARNING" for r in caplog.records)
    assert messages[0].startswith(
        "prefill attention runs in pure torch: FusedSDPA is not importable"
    )
    assert messages[1].startswith(
        "decode attention runs in pure torch: no usable vllm-hpu-extension"
    )


def test_the_fakes_keep_the_pinned_signatures():
    """Guards the fakes themselves: the parameters each release's flat_pa requires, in order."""
    base = [
        "query",
        "key_cache",
        "value_cache",
        "block_list",
        "block_mapping",
        "block_bias",
        "block_groups",
    ]
    tail = [
        "matmul_av_op",
        "batch2block_matmul_op",
        "block2batch_matmul_op",
        "keys_fetch_func",
        "values_fetch_func",
    ]
    expected = {
        "v1.21.0": base + ["scale", "matmul_qk_op"] + tail,
        "v1.21.3": base + ["block_size", "scale", "matmul_qk_op"] + tail,
        "v1.22.0": base + ["block_size", "scale", "matmul_qk_op", "position_bias"] + tail,
        "vllm-gaudi": base
        + ["block_size", "scale", "matmul_qk_op", "position_bias"]
        + tail
        + ["sinks", "k_scales", "v_scales"],
    }
    for version, names in expected.items():
        params = inspect.signature(FakeExtension(version).ops_functions()["flat_pa"]).parameters
        assert [n for n, p in params.items() if p.kind != p.VAR_KEYWORD] == names, version


@pytest.mark.parametrize("version, with_vllm", [("v1.21.0", True), ("v1.21.3", False)])
def test_v1_21_gets_the_model_type_before_its_flags_are_first_read(
    habana, monkeypatch, version, with_vllm
):
    """The 1.21 flat_pa reads enabled_flags(), which asserts "Missing values for parameters:
    {'model_type'}" unless environment.set_model_config ran first, and then keeps its answer."""
    extension = FakeExtension(version, with_vllm=with_vllm)
    serve(extension, monkeypatch, habana)
    assert extension.runtime_params == {"model_type": "llama"}
    assert extension.detected is not None and "fp32_softmax" not in extension.detected


def test_the_fakes_1_21_flags_refuse_a_missing_model_type():
    extension = FakeExtension("v1.21.3")
    with pytest.raises(AssertionError, match=r"Missing values for parameters: \{'model_type'\}"):
        extension.enabled_flags()


def test_model_type_of_native_and_fallback_models_keeps_qwen2s_fp32_softmax():
    from types import SimpleNamespace as NS

    native = NS(config=NS(architecture="Qwen2MoeForCausalLM"))
    fallback = NS(hf_model=NS(config=NS(model_type="qwen2")), config=NS(architecture="Gaudi"))
    assert hpu_attention.model_type(native) == "qwen2_moe"
    assert hpu_attention.model_type(NS(config=NS(architecture="Qwen2ForCausalLM"))) == "qwen2"
    assert hpu_attention.model_type(fallback) == "qwen2"
    extension = FakeExtension("v1.21.3")
    extension.set_model_config(NS(hf_config=NS(model_type=hpu_attention.model_type(fallback))))
    assert "fp32_softmax" in extension.enabled_flags()


def test_padding_groups_are_derived_once_per_forward(habana, monkeypatch):
    extension = FakeExtension("v1.22.0")
    original, seen = extension.ops_functions, []

    def recording_groups():
        functions = original()
        base = functions["flat_pa"]

        def flat_pa(*args, block_groups, **kwargs):
            seen.append(block_groups)
            return base(*args, block_groups=block_groups, **kwargs)

        flat_pa.__signature__ = inspect.signature(base)
        return {**functions, "flat_pa": flat_pa}

    extension.ops_functions = recording_groups
    serve(extension, monkeypatch, habana)  # its last forward: one decode step
    last = seen[-CONFIG.num_layers :]
    assert all(groups is last[0] for groups in last), "derived again in every layer"


CONTEXT_PLAN = BucketPlan(
    prefill=(PrefillBucket(2, 4), PrefillBucket(2, 4, 1)), decode=(DecodeBucket(2, 4),)
)


def _chunked_prefill(adapter) -> torch.Tensor:
    """Two 7-token prompts in two chunks: 4 tokens, then 3 after that one block of context."""
    runner = runner_for(tiny_model(), adapter, CONTEXT_PLAN)
    for bucket in CONTEXT_PLAN.prefill + CONTEXT_PLAN.decode:
        runner.warm(bucket)
    whole = prompts((7, 7))
    runner.prefill([PrefillInput(p.token_ids[:4], p.slots[:4]) for p in whole])
    rest = [PrefillInput(p.token_ids[4:], p.slots[4:], context_slots=p.slots[:4]) for p in whole]
    return runner.prefill(rest).logits


def test_prefill_after_cached_context_runs_in_fused_sdpa_with_the_past_kv(habana, monkeypatch):
    extension = FakeExtension("v1.22.0")
    extension.install(monkeypatch)
    adapter = get_adapter("hpu", graph_mode="lazy")
    assert adapter.attention_backend.context is not None
    extension.calls.update(fused_sdpa=0)
    logits = _chunked_prefill(adapter)
    # warmup's two buckets, then the two chunks: every layer of each through FusedSDPA
    assert extension.calls["fused_sdpa"] == 4 * CONFIG.num_layers
    torch.testing.assert_close(logits, _chunked_prefill(get_adapter("cpu")))


def test_vllm_gaudis_extension_is_preferred_and_the_kernels_are_named(habana, monkeypatch):
    """With vLLM installed, vllm_gaudi.extension (maintained) wins over vllm-hpu-extension (end of
    life) when both import; the adapter names the kernels it runs (Info.attention_impl)."""
    FakeExtension("v1.22.0").install(monkeypatch)
    FakeExtension("vllm-gaudi", with_vllm=True).install(monkeypatch)
    adapter = get_adapter("hpu", graph_mode="lazy")
    assert adapter.kernels.flat_pa.package == "vllm_gaudi.extension"
    named = adapter.kernel_names()
    assert named.startswith("attention: fusedsdpa+flat_pa vllm_gaudi.extension"), named
