"""Multimodal rope (M-RoPE, Qwen2-VL and Qwen2.5-VL): each token has three positions (temporal,
height, width), and the rotary frequencies are split in `mrope_section` bands, band i turning at
row i % 3's position, as transformers' Qwen2_5_VLRotaryEmbedding composes them. A token whose three
positions are equal (text) turns exactly as with plain rope."""

from __future__ import annotations

import torch

from engine.layers.rotary import RotaryEmbedding


def mrope_cos_sin(
    rotary: RotaryEmbedding, positions: torch.Tensor, sections: tuple[int, ...], dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [..., 1, rotary_dim] for positions [3, ...], looked up in the plain table (its
    halves are the same frequencies twice) and recomposed band by band with static slices."""
    half = rotary.cos.shape[-1] // 2
    if sum(sections) != half:
        raise ValueError(f"mrope_section {sections} does not add up to {half} frequencies")
    bounds, start = [], 0
    for size in sections:
        bounds.append((start, start + size))
        start += size

    def compose(table: torch.Tensor) -> torch.Tensor:
        rows = table[0, positions]  # [3, ..., rotary_dim]
        bands = [rows[i % 3, ..., a:b] for i, (a, b) in enumerate(bounds)]
        bands += [rows[i % 3, ..., half + a : half + b] for i, (a, b) in enumerate(bounds)]
        return torch.cat(bands, dim=-1).unsqueeze(-2).to(dtype)

    return compose(rotary.cos), compose(rotary.sin)
