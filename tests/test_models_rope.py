"""Our rope tables equal transformers' frequency functions for every rope type we parse."""

import pytest
import torch
from transformers import LlamaConfig, Phi3Config
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.layers.rotary import attention_factor, position_angles
from engine.models.rope_config import parse_rope

HEAD = 16
SCALINGS = {
    "linear": dict(factor=4.0),
    "yarn": dict(factor=4.0, original_max_position_embeddings=64, beta_fast=16, beta_slow=2),
    "dynamic": dict(factor=2.0),
    "llama3": dict(
        factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=32
    ),
}


def llama_config(rope_type: str) -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        head_dim=HEAD,
        max_position_embeddings=128,
        rope_parameters={"rope_type": rope_type, "rope_theta": 10000.0, **SCALINGS[rope_type]},
    )


@pytest.mark.parametrize("rope_type", ["linear", "yarn", "llama3"])
def test_static_schedules_match_transformers(rope_type):
    config = llama_config(rope_type)
    inv_freq, factor = ROPE_INIT_FUNCTIONS[rope_type](config)
    rope, _ = parse_rope(config.to_dict())
    positions = torch.arange(200).float()
    torch.testing.assert_close(position_angles(rope, HEAD, 200), torch.outer(positions, inv_freq))
    assert attention_factor(rope) == pytest.approx(factor)


def test_dynamic_ntk_uses_each_positions_own_length():
    config = llama_config("dynamic")
    rope, _ = parse_rope(config.to_dict())
    angles = position_angles(rope, HEAD, 300)
    for position in (5, 127, 128, 200, 299):  # below, at and past max_position_embeddings
        inv_freq, _ = ROPE_INIT_FUNCTIONS["dynamic"](config, seq_len=position + 1)
        torch.testing.assert_close(angles[position], position * inv_freq)


def test_longrope_switches_to_long_factors_past_the_pretraining_length():
    config = Phi3Config(
        hidden_size=64,
        num_attention_heads=4,
        max_position_embeddings=256,
        original_max_position_embeddings=64,
        pad_token_id=0,
        rope_parameters={
            "rope_type": "longrope",
            "rope_theta": 10000.0,
            "partial_rotary_factor": 0.5,
            "short_factor": [1.0, 1.5, 2.0, 3.0],
            "long_factor": [2.0, 4.0, 8.0, 16.0],
        },
    )
    short, factor = ROPE_INIT_FUNCTIONS["longrope"](config)
    long, _ = ROPE_INIT_FUNCTIONS["longrope"](config, seq_len=65)
    rope, _ = parse_rope(config.to_dict())
    angles = position_angles(rope, HEAD, 100)
    assert angles.shape == (100, 4)  # a partial rotary factor of 0.5: 8 of 16 dimensions rotate
    torch.testing.assert_close(angles[63], 63 * short)
    torch.testing.assert_close(angles[64], 64 * long)
    assert attention_factor(rope) == pytest.approx(factor) and factor > 1
