"""Pre-quantized FP8 checkpoints (engine/layers/fp8.py): loaded with their scales, per channel and
per tensor; on CPU the dequantizing reference runs, and its greedy tokens equal transformers on the
dequantized weights."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.errors import ModelLoadError
from engine.layers.fp8 import FP8, Fp8Weight
from engine.serving.shard import Shard
from launcher.generate import generate
from tests.conftest import tiny_config
from tests.test_equivalence import PROMPTS
from tests.test_quant_models import dequantized_state, greedy, transformers_on

PER_TENSOR = ("o_proj", "down_proj")  # the others get one scale per output row


def fp8_checkpoint(source, out):
    """`source`'s projections as float8_e4m3fn with weight_scale, as llm-compressor writes them."""
    shutil.copytree(source, out)
    state = load_file(out / "model.safetensors")
    for name in [n for n in state if "_proj.weight" in n]:
        weight = state[name].float()
        per_tensor = any(p in name for p in PER_TENSOR)
        amax = weight.abs().amax() if per_tensor else weight.abs().amax(1, keepdim=True)
        scale = amax / torch.finfo(FP8).max
        state[name] = (weight / scale).to(FP8)
        state[name.removesuffix("weight") + "weight_scale"] = (
            scale.reshape([]) if per_tensor else scale
        )
    save_file(state, out / "model.safetensors")
    return out


@pytest.fixture(scope="module")
def fp8_dir(tiny_model_dirs, tmp_path_factory):
    return fp8_checkpoint(tiny_model_dirs["llama"], tmp_path_factory.mktemp("fp8") / "llama")


def test_fp8_linear_is_the_scaled_weight():
    weight = (torch.randn(6, 8) * 10).to(FP8)
    layer, x = Fp8Weight(weight, torch.tensor([0.5])), torch.randn(3, 8)
    expected = weight.float() * 0.5
    torch.testing.assert_close(layer.dequantize(), expected)
    torch.testing.assert_close(layer.linear(x), x @ expected.t())


def test_fp8_checkpoint_greedy_tokens_equal_transformers_on_its_dequantized_weights(
    tiny_model_dirs, fp8_dir
):
    shard = Shard(tiny_config(fp8_dir, quantize="fp8"), show_progress=False)
    attn = shard.model.layers[0].self_attn
    assert (
        attn.qkv_proj.quantized.kind == "fp8" and attn.o_proj.quantized.scale.unique().numel() == 1
    )
    assert attn.qkv_proj.quantized.scale.unique().numel() > 3  # per channel, fused q/k/v kept apart
    state, original = (
        dequantized_state(shard.model),
        load_file(tiny_model_dirs["llama"] / "model.safetensors"),
    )
    for name in ("model.layers.1.self_attn.k_proj.weight", "model.layers.0.mlp.down_proj.weight"):
        # e4m3 keeps 3 mantissa bits: within 1/16 of each weight (plus the smallest steps near zero)
        assert ((state[name] - original[name]).abs() <= original[name].abs() / 16 + 1e-3).all(), (
            name
        )
    ours = generate(shard, PROMPTS, 16, ignore_eos=True)
    reference = transformers_on(tiny_model_dirs["llama"], state, torch.float32)
    for completion, prompt in zip(ours, PROMPTS):
        assert completion.token_ids == greedy(reference, shard.tokenizer, prompt, 16)
    assert shard.adapter.shapes.strict and not shard.adapter.shapes.unwarmed


def test_fp8_checkpoint_without_the_flag_is_refused(fp8_dir):
    with pytest.raises(
        ModelLoadError, match="pre-quantized FP8 checkpoint; serve it with --quantize fp8"
    ):
        Shard(tiny_config(fp8_dir), show_progress=False)
