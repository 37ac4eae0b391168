"""Model directories, GGUF conversion and the errors a user meets with bad model files."""

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import ModelLoadError
from engine.models.config import ModelConfig
from engine.weights.loader import (
    build_model,
    convert_gguf,
    embedded_gguf_path,
    load,
    load_weights,
    read_config,
    resolve_model_dir,
    weight_files,
)
from engine.weights.placement import Placement

CPU = torch.device("cpu")


def copy_model(src, dst):
    shutil.copytree(src, dst)
    return dst


def test_unsupported_architecture_names_the_supported_ones(tiny_model_dirs, tmp_path):
    model_dir = copy_model(tiny_model_dirs["llama"], tmp_path / "m")
    config = json.loads((model_dir / "config.json").read_text())
    config["architectures"] = ["GPT2LMHeadModel"]
    (model_dir / "config.json").write_text(json.dumps(config))
    with pytest.raises(
        ModelLoadError,
        match=r"'GPT2LMHeadModel' is not supported \(supported: Gemma2ForCausalLM, Gemma3ForCausalLM, Gemma3ForConditionalGeneration, LlamaForCausalLM, LlavaForConditionalGeneration, LlavaNextForConditionalGeneration, MistralForCausalLM, MixtralForCausalLM, Phi3ForCausalLM, Qwen2ForCausalLM, Qwen2_5_VLForConditionalGeneration, Qwen3ForCausalLM, Qwen3MoeForCausalLM\)",
    ):
        load(str(model_dir), tmp_path, Placement(torch.float32, CPU), implementation="native")


def test_missing_weight_files(tiny_model_dirs, tmp_path):
    model_dir = copy_model(tiny_model_dirs["llama"], tmp_path / "m")
    (model_dir / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors weight files"):
        load(str(model_dir), tmp_path, Placement(torch.float32, CPU))


def test_corrupt_weight_file(tiny_model_dirs, tmp_path):
    model_dir = copy_model(tiny_model_dirs["llama"], tmp_path / "m")
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(ModelLoadError, match="corrupt or unreadable"):
        load(str(model_dir), tmp_path, Placement(torch.float32, CPU))


def test_missing_tensor_is_named(tiny_model_dirs, tmp_path):
    model_dir = copy_model(tiny_model_dirs["llama"], tmp_path / "m")
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(ModelLoadError, match="layers.1.self_attn.qkv_proj.weight"):
        load(str(model_dir), tmp_path, Placement(torch.float32, CPU))


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        resolve_model_dir(str(tmp_path / "nowhere"), tmp_path)


def test_sharded_checkpoint_with_index_loads_the_same_weights(
    tiny_model_dirs, tmp_path, smollm_dir
):
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(tiny_model_dirs["qwen2"]).save_pretrained(
        sharded, max_shard_size="1MB"
    )
    assert (sharded / "model.safetensors.index.json").is_file() and len(weight_files(sharded)) > 1
    config = read_config(sharded)
    whole, split = (build_model(config, Placement(torch.float32, CPU), 64) for _ in range(2))
    load_weights(whole, weight_files(tiny_model_dirs["qwen2"]))
    load_weights(split, weight_files(sharded))
    for (name, a), (_, b) in zip(whole.state_dict().items(), split.state_dict().items()):
        assert torch.equal(a, b), name
    assert split.lm_head.weight is split.embed_tokens.weight  # tied stays tied


def test_fused_projections_hold_the_checkpoint_slices(tiny_model_dirs):
    model_dir = tiny_model_dirs["qwen2"]
    model = build_model(read_config(model_dir), Placement(torch.float32, CPU), 64)
    load_weights(model, weight_files(model_dir))
    tensors = load_file(model_dir / "model.safetensors")
    attn = model.layers[1].self_attn
    q, k, v = attn.qkv_proj.weight.split([attn.q_size, attn.kv_size, attn.kv_size])
    assert torch.equal(k, tensors["model.layers.1.self_attn.k_proj.weight"])
    assert torch.equal(
        attn.qkv_proj.bias[attn.q_size + attn.kv_size :],
        tensors["model.layers.1.self_attn.v_proj.bias"],
    )
    gate, up = model.layers[0].mlp.gate_up_proj.weight.chunk(2)
    assert torch.equal(up, tensors["model.layers.0.mlp.up_proj.weight"])


def test_legacy_rope_fields_parse_like_rope_parameters():
    base = {
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 10,
        "hidden_size": 8,
        "intermediate_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
    }
    scaling = {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    legacy = ModelConfig.from_hf(
        {**base, "rope_theta": 5e5, "rope_scaling": {"rope_type": "llama3", **scaling}}
    )
    modern = ModelConfig.from_hf(
        {**base, "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, **scaling}}
    )
    assert legacy == modern and legacy.rope.rope_type == "llama3" and legacy.rope.theta == 5e5
    with pytest.raises(ModelLoadError, match="rope type 'proportional' is not supported"):
        ModelConfig.from_hf({**base, "rope_scaling": {"rope_type": "proportional", "factor": 2.0}})


def test_gguf_conversion_is_cached(smollm_dir, tmp_path):
    gguf = embedded_gguf_path()
    assert resolve_model_dir(None, smollm_dir.parent.parent) == smollm_dir
    stamp = (smollm_dir / "model.safetensors").stat().st_mtime_ns
    assert convert_gguf(gguf, smollm_dir.parent.parent) == smollm_dir
    assert (smollm_dir / "model.safetensors").stat().st_mtime_ns == stamp  # not converted again
    assert read_config(smollm_dir).num_layers == 30 and read_config(smollm_dir).num_kv_heads == 3


def test_corrupt_gguf_is_a_clear_error(tmp_path):
    bad = tmp_path / "broken.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="cannot read GGUF file"):
        resolve_model_dir(str(bad), tmp_path / "cache")
    assert not list((tmp_path / "cache" / "models").glob("broken*"))  # no half-written cache entry
