"""Tiny random models of the natively implemented families beyond Llama, saved as Hugging Face
directories that share the embedded model's tokenizer (tests/models.py builds them).

Each is small (2 layers, hidden 64) but switches on what makes its family different: sliding
windows shorter than the test prompts plus their generations, soft-capping low enough to bite,
mixed dense and MoE layers, longrope past its pretraining length with a partial rotary factor.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.models import build_tiny_model

WINDOW = (
    24  # test prompts run to ~50 tokens and generate 40 more: sliding layers slide in both phases
)
FAMILIES = {
    "qwen3": (
        "Qwen3Config",
        dict(
            tie_word_embeddings=False,
            use_sliding_window=True,
            sliding_window=WINDOW,
            max_window_layers=1,
        ),
    ),
    "gemma2": (
        "Gemma2Config",
        dict(
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=4.0,
            final_logit_softcapping=8.0,
            layer_types=["sliding_attention", "full_attention"],
        ),
    ),
    "gemma3": (
        "Gemma3TextConfig",
        dict(
            sliding_window=WINDOW,
            query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1_000_000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
            },
        ),
    ),
    "phi3": (
        "Phi3Config",
        dict(
            head_dim=None,
            num_key_value_heads=2,
            pad_token_id=0,
            original_max_position_embeddings=128,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.5,
                "short_factor": [1.0, 1.2, 1.5, 2.0],
                "long_factor": [1.0, 2.0, 4.0, 8.0],
            },
        ),
    ),
    "mixtral": (
        "MixtralConfig",
        dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=32),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=96,
            norm_topk_prob=True,
            mlp_only_layers=[0],
        ),
    ),
}


def build_family_model(family: str, out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    config_name, extra = FAMILIES[family]
    return build_tiny_model(
        family,
        out_dir,
        tokenizer_dir,
        seed,
        variants={family: (config_name, extra)},
        randomize_norms=True,
    )


@pytest.fixture(scope="session")
def family_dirs(tmp_path_factory, smollm_dir):
    """family -> directory of its tiny model (import this fixture into a test module to use it)."""
    root = tmp_path_factory.mktemp("families")
    return {family: build_family_model(family, root / family, smollm_dir) for family in FAMILIES}
