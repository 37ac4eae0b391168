"""The embedded SmolLM2 Q4_1 GGUF loaded into int4 as stored (engine/weights/gguf.py, engine/weights/quantize.py)."""

import pytest
import torch
from safetensors import safe_open

from engine.config import default_cache_dir
from engine.layers.quant import weight_bytes
from engine.weights import loader
from engine.weights.gguf import read_weights
from engine.weights.placement import Placement
from tests.test_quant_models import dequantized_state, greedy, transformers_on


@pytest.fixture(scope="module")
def gguf_weights():
    return read_weights(loader.embedded_gguf_path(), 9, 3)


def test_q4_1_blocks_decode_to_transformers_own_dequantization(gguf_weights, smollm_dir):
    """Codes, scales and zeros read from the blocks (q/k rows permuted back) equal the float32
    weights transformers' GGUF loader wrote when it converted the same file."""
    names = [
        "layers.0.self_attn.q_proj.weight",
        "layers.0.self_attn.k_proj.weight",
        "layers.7.mlp.down_proj.weight",
        "layers.29.self_attn.v_proj.weight",
    ]
    with safe_open(loader.weight_files(smollm_dir)[0], framework="pt") as reader:
        for name in names:
            expected = reader.get_tensor(f"model.{name}")
            torch.testing.assert_close(
                gguf_weights[name].dequantize(), expected, rtol=1e-6, atol=1e-6
            )


def test_q4_1_model_keeps_its_blocks_in_about_a_fifth_of_the_memory(smollm_dir):
    placement = Placement(torch.bfloat16, torch.device("cpu"), quantize="int4")
    model = loader.load(None, default_cache_dir(), placement).model
    assert {type(layer.mlp.gate_up_proj.quantized).__name__ for layer in model.layers} == {
        "Int4Weight"
    }
    assert model.lm_head.quantized is model.embed_tokens.quantized  # tied: one int8 copy
    assert weight_bytes(model) < 105e6  # float32: 542 MB
    with safe_open(loader.weight_files(smollm_dir)[0], framework="pt") as reader:
        expected = reader.get_tensor("model.layers.3.self_attn.q_proj.weight")
    ours = model.layers[3].self_attn.qkv_proj.quantized.dequantize()[:576]
    # the file's scales and zeros rounded to bfloat16: within a fraction of a percent of the largest weight
    assert (ours - expected).abs().max() < 0.005 * expected.abs().max()


@pytest.mark.slow
def test_q4_1_model_greedy_tokens_equal_transformers_on_the_dequantized_weights(smollm_dir):
    from engine.serving.shard import Shard
    from launcher.generate import generate
    from tests.conftest import tiny_config

    shard = Shard(
        tiny_config(smollm_dir, model_id=None, quantize="int4"), show_progress=False
    )  # the embedded GGUF, float32
    prompts = ["The quick brown fox"]  # short: the int4 kernel with float32 activations is slow
    ours = generate(shard, prompts, 4, ignore_eos=True)
    reference = transformers_on(smollm_dir, dequantized_state(shard.model), torch.float32)
    assert [c.token_ids for c in ours] == [
        greedy(reference, shard.tokenizer, p, 4) for p in prompts
    ]
