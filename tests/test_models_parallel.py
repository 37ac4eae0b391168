"""Tensor parallelism of the new native families with real shard processes on CPU (gloo):
two shards give transformers' tokens, as one shard does (MoE experts split on their intermediate
dimension; Gemma 2's soft-capped, sliding-window attention split by heads)."""

import pytest

from tests.family_models import family_dirs  # noqa: F401 (a fixture)
from tests.test_equivalence import PROMPTS, reference_tokens
from tests.test_tensor_parallel import NEW_TOKENS, run_sharded


@pytest.mark.slow
@pytest.mark.parametrize("family", ["qwen3_moe", "gemma2"])
def test_two_shards_give_the_tokens_of_one(family_dirs, family):
    model_dir = family_dirs[family]
    expected = reference_tokens(model_dir, PROMPTS, NEW_TOKENS)
    tokens = run_sharded(model_dir, 2)
    assert [tokens[i] for i in range(6)] == expected


@pytest.mark.slow
@pytest.mark.parametrize("name", ["granite", "olmo2"])
def test_two_fallback_shards_give_the_tokens_of_one(tmp_path_factory, smollm_dir, name):
    """Granite's plan splits attention heads; Olmo2's gathers q/k/v (its norms span all heads)."""
    from tests.models import build_tiny_model
    from tests.test_models_fallback import FALLBACKS

    model_dir = build_tiny_model(
        name, tmp_path_factory.mktemp("tp") / name, smollm_dir, variants=FALLBACKS
    )
    expected = reference_tokens(model_dir, PROMPTS, NEW_TOKENS)
    tokens = run_sharded(model_dir, 2)
    assert [tokens[i] for i in range(6)] == expected


def test_ranks_hold_their_rows_of_stacked_and_expert_tensors(family_dirs):
    """Phi-3's stacked qkv/gate_up and Qwen3-MoE's per-expert tensors: each rank loads its own slice."""
    import torch
    from safetensors.torch import load_file

    from engine.distributed import Parallel
    from engine.weights.loader import build_model, load_weights, read_config, weight_files
    from engine.weights.placement import Placement

    phi3 = family_dirs["phi3"]
    model = build_model(
        read_config(phi3), Placement(torch.float32, torch.device("cpu"), Parallel(1, 2)), 64
    )
    load_weights(model, weight_files(phi3))
    fused = load_file(phi3 / "model.safetensors")[
        "model.layers.0.self_attn.qkv_proj.weight"
    ]  # q 64, k 32, v 32 rows
    attn = model.layers[0].self_attn
    torch.testing.assert_close(
        attn.qkv_proj.weight, torch.cat([fused[32:64], fused[80:96], fused[112:128]])
    )
    gate_up = load_file(phi3 / "model.safetensors")[
        "model.layers.1.mlp.gate_up_proj.weight"
    ]  # gate 128, up 128
    torch.testing.assert_close(
        model.layers[1].mlp.gate_up_proj.weight, torch.cat([gate_up[64:128], gate_up[192:256]])
    )

    moe_dir = family_dirs["qwen3_moe"]
    model = build_model(
        read_config(moe_dir), Placement(torch.float32, torch.device("cpu"), Parallel(1, 2)), 64
    )
    load_weights(model, weight_files(moe_dir))
    tensors = load_file(moe_dir / "model.safetensors")
    block = model.layers[1].mlp  # layer 0 is dense (mlp_only_layers)
    torch.testing.assert_close(
        block.gate_up[2, :48], tensors["model.layers.1.mlp.experts.2.gate_proj.weight"][48:]
    )
    torch.testing.assert_close(
        block.gate_up[2, 48:], tensors["model.layers.1.mlp.experts.2.up_proj.weight"][48:]
    )
    torch.testing.assert_close(
        block.down[3], tensors["model.layers.1.mlp.experts.3.down_proj.weight"][:, 48:]
    )
