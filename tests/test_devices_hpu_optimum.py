"""optimum-habana on the HPU's transformers fallback (engine/devices/hpu/optimum.py), against a fake as strict
as v1.19.1 (tests/fakes/optimum_habana.py): adapt_transformers_to_gaudi() is applied, a Gaudi variant that
keeps its own attention and KV cache is taken back out (with a warning naming why) so the fallback still
runs its attention through our paged cache, and an optimum-habana that cannot be imported is reported."""

import logging

import pytest
import torch
import transformers
from transformers import AttentionInterface, AutoConfig
from transformers.generation import GenerationMixin
from transformers.models.llama import modeling_llama

from engine.devices.cpu.adapter import CPUAdapter
from engine.devices.hpu import optimum as hpu_optimum
from engine.models.fallback import ATTENTION_NAME
from engine.weights.fallback import load_transformers_model
from engine.weights.placement import Placement
from tests.fakes.optimum_habana import FakeOptimumHabana
from tests.fakes.optimum_habana_llama import GaudiLlamaForCausalLM
from tests.models import build_tiny_model
from tests.test_devices_docker import REPO, instructions
from tests.test_devices_hpu import habana, hpu  # noqa: F401 - the fake bridge fixture
from tests.test_models_fallback import FALLBACKS

ORIGINAL_LLAMA, ORIGINAL_ATTENTION, ORIGINAL_GENERATE = (
    modeling_llama.LlamaForCausalLM,
    modeling_llama.LlamaAttention,
    GenerationMixin.generate,
)


@pytest.fixture
def optimum(monkeypatch):
    monkeypatch.setattr(hpu_optimum, "_state", {"adapted": False, "reported": False})
    fake = FakeOptimumHabana(monkeypatch)
    yield fake
    monkeypatch.undo()
    assert (
        modeling_llama.LlamaForCausalLM is ORIGINAL_LLAMA
        and GenerationMixin.generate is ORIGINAL_GENERATE
    )


def load(model_dir, prepare):
    model, _ = load_transformers_model(
        model_dir, Placement(torch.float32, torch.device("cpu")), prepare
    )
    return model.hf_model


def test_a_gaudi_variant_with_its_own_attention_is_taken_back_out(optimum, tiny_model_dirs, caplog):
    optimum.install()
    with caplog.at_level(logging.WARNING, logger="engine.devices.hpu.optimum"):
        hf_model = load(tiny_model_dirs["llama"], hpu_optimum.adapt_for_fallback)
    assert (
        optimum.calls == 1 and GenerationMixin.generate is not ORIGINAL_GENERATE
    )  # applied, process-wide
    assert (
        type(hf_model) is ORIGINAL_LLAMA
        and type(hf_model.model.layers[0].self_attn) is ORIGINAL_ATTENTION
    )
    assert (
        modeling_llama.LlamaForCausalLM is ORIGINAL_LLAMA
        and modeling_llama.LlamaAttention is ORIGINAL_ATTENTION
    )
    assert hf_model.config._attn_implementation == ATTENTION_NAME
    assert (
        "GaudiLlamaForCausalLM keeps its own KV cache" in caplog.text
        and "un-adapted LlamaForCausalLM" in caplog.text
    )
    # a second model in the same process: no second adaptation, the same decision
    assert hpu_optimum.adapt_for_fallback(ORIGINAL_LLAMA) is ORIGINAL_LLAMA and optimum.calls == 1


def test_the_verdict_matches_what_the_classes_do(optimum, tiny_model_dirs):
    """The fake's Gaudi attention never calls the registered function; transformers' own does."""
    optimum.install()
    calls = []

    def spy(module, query, key, value, attention_mask, **kwargs):
        calls.append(module)
        return transformers.integrations.sdpa_attention.sdpa_attention_forward(
            module, query, key, value, attention_mask, **kwargs
        )

    AttentionInterface.register("spy", spy)
    config = AutoConfig.from_pretrained(tiny_model_dirs["llama"])
    config._attn_implementation = "spy"
    ids = torch.tensor([[1, 5, 9]])
    optimum.adapt_transformers_to_gaudi()
    GaudiLlamaForCausalLM(config).eval()(ids)
    assert not calls and not hpu_optimum.routes_through_interface(GaudiLlamaForCausalLM)
    optimum.monkeypatch.setattr(modeling_llama, "LlamaAttention", ORIGINAL_ATTENTION)
    ORIGINAL_LLAMA(config).eval()(ids)
    assert calls and hpu_optimum.routes_through_interface(ORIGINAL_LLAMA)


def test_an_architecture_without_a_gaudi_variant_is_served_adapted(
    optimum, tmp_path, smollm_dir, caplog
):
    optimum.install()
    model_dir = build_tiny_model("olmo2", tmp_path / "olmo2", smollm_dir, variants=FALLBACKS)
    with caplog.at_level(logging.WARNING, logger="engine.devices.hpu.optimum"):
        hf_model = load(model_dir, hpu_optimum.adapt_for_fallback)
    assert (
        optimum.calls == 1 and type(hf_model) is transformers.Olmo2ForCausalLM and not caplog.text
    )


def test_an_optimum_habana_that_cannot_be_imported_is_reported_once(
    optimum, tiny_model_dirs, caplog
):
    optimum.install(importable=False)
    with caplog.at_level(logging.WARNING, logger="engine.devices.hpu.optimum"):
        assert hpu_optimum.adapt_for_fallback(ORIGINAL_LLAMA) is ORIGINAL_LLAMA
        assert hpu_optimum.adapt_for_fallback(ORIGINAL_LLAMA) is ORIGINAL_LLAMA
    assert caplog.text.count("transformers.modeling_attn_mask_utils") == 1 and optimum.calls == 0


def test_only_the_hpu_adapter_adapts(optimum, habana):  # noqa: F811 - the fake bridge
    optimum.install()
    assert (
        CPUAdapter().prepare_transformers(ORIGINAL_LLAMA) is ORIGINAL_LLAMA and optimum.calls == 0
    )
    assert hpu().prepare_transformers(ORIGINAL_LLAMA) is ORIGINAL_LLAMA and optimum.calls == 1


def test_the_gaudi_image_pins_the_release_the_fake_mirrors():
    found = instructions("Dockerfile_gaudi")
    args = dict(a.split("=", 1) for a in found["ARG"] if "=" in a)
    release, gaudi = hpu_optimum.PINNED
    assert args["OPTIMUM_HABANA_VERSION"] == release and args["GAUDI_VERSION"].startswith(
        gaudi + "."
    )
    assert f"v{release}" in (REPO / "tests" / "fakes" / "optimum_habana.py").read_text()
    (run,) = [r for r in found["RUN"] if "optimum-habana==" in r]
    assert "--no-deps" in run and "PIP_CONSTRAINT=/etc/pip-habana-constraints.txt" in run
