"""The transformers fallback: architectures we do not implement run through transformers with our
attention function on the paged KV cache, in warmed buckets, token-exact against transformers'
own generate; what it cannot serve is refused with one clear error."""

import json

import pytest
import torch

from engine.errors import ModelLoadError
from engine.models.fallback import TransformersCausalLM
from engine.serving.shard import Shard
from engine.weights.loader import load
from engine.weights.placement import Placement
from launcher.generate import generate
from tests.conftest import tiny_config
from tests.models import build_tiny_model
from tests.test_equivalence import NEW_TOKENS, PROMPTS, reference_tokens

# Not natively implemented; each with something of its own: Olmo2's norms after the projections,
# Starcoder2's LayerNorm, biases and a sliding window shorter than the test sequences, Granite's
# multipliers, GPT-NeoX's fused qkv, partial rotary and parallel residual. The second GPT-NeoX
# keeps the shared shape's num_key_value_heads and head_dim, fields its config stores but its
# modules never read: the cache geometry must be what the modules compute. StableLM's class lacks
# transformers' attention-backend flag, yet its modules call the interface (partial rotary, q/k/v
# biases).
FALLBACKS = {
    "olmo2": ("Olmo2Config", dict(tie_word_embeddings=False)),
    "starcoder2": ("Starcoder2Config", dict(head_dim=None, sliding_window=24)),
    "granite": (
        "GraniteConfig",
        dict(
            embedding_multiplier=2.0,
            residual_multiplier=0.5,
            logits_scaling=2.0,
            attention_multiplier=0.2,
        ),
    ),
    "gpt_neox": ("GPTNeoXConfig", dict(head_dim=None, num_key_value_heads=None, rotary_pct=0.5)),
    "gpt_neox_stray_fields": ("GPTNeoXConfig", dict(rotary_pct=0.5)),
    "stablelm": ("StableLmConfig", dict(partial_rotary_factor=0.5, use_qkv_bias=True)),
}


@pytest.fixture(scope="module")
def fallback_dirs(tmp_path_factory, smollm_dir):
    root = tmp_path_factory.mktemp("fallbacks")
    return {
        name: build_tiny_model(name, root / name, smollm_dir, variants=FALLBACKS)
        for name in FALLBACKS
    }


@pytest.mark.parametrize("name", list(FALLBACKS))
def test_fallback_architecture_matches_transformers(fallback_dirs, name):
    model_dir = fallback_dirs[name]
    shard = Shard(tiny_config(model_dir), show_progress=False)
    assert (
        isinstance(shard.model, TransformersCausalLM)
        and shard.info().attention_impl == "transformers+flat_paged"
    )
    ours = generate(shard, PROMPTS, NEW_TOKENS, ignore_eos=True)
    assert [c.token_ids for c in ours] == reference_tokens(model_dir, PROMPTS, NEW_TOKENS)
    assert shard.adapter.shapes.strict and not shard.adapter.shapes.unwarmed


def test_a_native_architecture_forced_through_the_fallback(tiny_model_dirs):
    model_dir = tiny_model_dirs["qwen2"]
    shard = Shard(tiny_config(model_dir, implementation="transformers"), show_progress=False)
    assert isinstance(shard.model, TransformersCausalLM)
    ours = generate(shard, PROMPTS, NEW_TOKENS, ignore_eos=True)
    assert [c.token_ids for c in ours] == reference_tokens(model_dir, PROMPTS, NEW_TOKENS)


def write_config(tmp_path, config) -> str:
    config.architectures = config.architectures or [
        type(config).__name__.replace("Config", "Model")
    ]
    config.save_pretrained(tmp_path)
    return str(tmp_path)


def refused_model_dirs(tmp_path) -> list[tuple[str, str]]:
    """(model directory, the reason its refusal must give) for each kind of model we refuse."""
    import transformers

    cases = {
        "encoder-decoder": (
            transformers.T5Config(d_model=32, num_layers=1, num_heads=2),
            "is an encoder-decoder model",
        ),
        "vision": (
            transformers.ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2),
            "has no causal language model in transformers",
        ),
    }
    dirs = [
        (write_config(tmp_path / name.replace(" ", "_"), config), message)
        for name, (config, message) in cases.items()
    ]
    unknown = tmp_path / "unknown"
    unknown.mkdir()
    (unknown / "config.json").write_text(
        json.dumps({"model_type": "no-such-model", "architectures": ["NoSuchForCausalLM"]})
    )
    return dirs + [(str(unknown), "transformers cannot build a model from")]


def test_refusals_name_the_reason(tmp_path):
    for model_dir, message in refused_model_dirs(tmp_path):
        with pytest.raises(ModelLoadError, match=message):
            load(model_dir, tmp_path, Placement(torch.float32, torch.device("cpu")))


def test_sharding_a_fallback_without_a_tp_plan_is_refused(tmp_path):
    import transformers

    from engine.distributed import Parallel

    model_dir = write_config(
        tmp_path / "gpt2",
        transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, architectures=["GPT2LMHeadModel"]),
    )
    with pytest.raises(ModelLoadError, match="GPT2LMHeadModel declares no tensor-parallel plan"):
        load(model_dir, tmp_path, Placement(torch.float32, torch.device("cpu"), Parallel(0, 2)))


def test_lora_adapters_on_the_fallback_are_refused(tiny_model_dirs):
    config = tiny_config(
        tiny_model_dirs["qwen2"], implementation="transformers", lora_adapters=(("a", "/a"),)
    )
    with pytest.raises(
        ModelLoadError, match="LoRA adapters are served with native implementations only"
    ):
        Shard(config, show_progress=False)


def attend_by_itself(self, hidden_states, position_embeddings, attention_mask=None, **kwargs):
    """LlamaAttention.forward computing its attention itself, as a model outside transformers'
    attention interface does (and as the probe must notice)."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb, repeat_kv

    shape = (*hidden_states.shape[:-1], -1, self.head_dim)
    projections = (self.q_proj, self.k_proj, self.v_proj)
    q, k, v = (proj(hidden_states).view(shape).transpose(1, 2) for proj in projections)
    q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
    k, v = repeat_kv(k, self.num_key_value_groups), repeat_kv(v, self.num_key_value_groups)
    out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    return self.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None


def load_through_the_fallback(model_dir, tmp_path):
    return load(
        str(model_dir),
        tmp_path,
        Placement(torch.float32, torch.device("cpu")),
        implementation="transformers",
    )


def test_a_model_attending_outside_the_interface_is_refused(tiny_model_dirs, tmp_path, monkeypatch):
    from transformers.models.llama import modeling_llama

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", attend_by_itself)
    refusal = (
        "LlamaForCausalLM does not run its attention through transformers' attention "
        r"interface \(a probe forward made no call into it\)"
    )
    with pytest.raises(ModelLoadError, match=refusal):
        load_through_the_fallback(tiny_model_dirs["llama"], tmp_path)


def test_a_model_attending_outside_the_interface_in_some_layers_is_refused(
    tiny_model_dirs, tmp_path, monkeypatch
):
    from transformers.models.llama import modeling_llama

    interface_forward = modeling_llama.LlamaAttention.forward

    def first_layer_by_itself(self, *args, **kwargs):
        forward = attend_by_itself if self.layer_idx == 0 else interface_forward
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(modeling_llama.LlamaAttention, "forward", first_layer_by_itself)
    refusal = (
        r"calls transformers' attention interface from layers \[1\], not once from each "
        "of its 2 layers"
    )
    with pytest.raises(ModelLoadError, match=refusal):
        load_through_the_fallback(tiny_model_dirs["llama"], tmp_path)
