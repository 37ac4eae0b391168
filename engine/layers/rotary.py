"""Rotary position embedding and the frequency schedules of the checkpoints we serve.

cos/sin are precomputed for every position and looked up with a positions *tensor*, so a graph
never sees a sequence length as a Python scalar. Schedules whose frequencies depend on the length
`dynamic` is tabulated per position: position p uses what a sequence of p + 1 tokens uses, so a
token's rotation never depends on the other rows of its batch. `longrope` keeps two tables, short
and long, and picks one per *sequence* from a tensor: a row whose last position in the forward has
reached original_max_position_embeddings rotates every token with the long factors, as transformers
does for the sequence of a forward (a prompt past the boundary is rotated long from position 0).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

ROPE_TYPES = ("default", "linear", "llama3", "dynamic", "yarn", "longrope")


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    rope_type: str = "default"
    factor: float = 1.0
    partial_rotary_factor: float = (
        1.0  # rotate only the first fraction of each head (Phi-3 mini-style)
    )
    max_position_embeddings: int = 4096  # the model's; dynamic NTK scales past it
    original_max_position_embeddings: int = 8192  # llama3, yarn, longrope: the pretraining length
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    truncate: bool = True
    # yarn and longrope: multiplies cos and sin; None derives it from the factor
    attention_factor: float | None = None
    # longrope: per-frequency divisors below and past original_max_position_embeddings
    short_factor: tuple[float, ...] = ()
    long_factor: tuple[float, ...] = ()

    def rotary_dim(self, head_dim: int) -> int:
        return int(head_dim * self.partial_rotary_factor)


def _exponents(dim: int) -> torch.Tensor:
    return torch.arange(0, dim, 2, dtype=torch.int64).float() / dim


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:
    """Frequencies of the position-independent schedules (not dynamic, longrope)."""
    dim = rope.rotary_dim(head_dim)
    inv_freq = 1.0 / (rope.theta ** _exponents(dim))
    if rope.rope_type == "linear":
        return inv_freq / rope.factor
    if rope.rope_type == "llama3":
        return _llama3_schedule(inv_freq, rope)
    if rope.rope_type == "yarn":
        return _yarn_schedule(rope, dim)
    return inv_freq


def _llama3_schedule(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are slowed by `factor`, short ones kept, the band between interpolated.
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_schedule(rope: RopeConfig, dim: int) -> torch.Tensor:
    # High frequencies (many rotations within the pretraining length) are kept, low ones
    # interpolated by `factor`, with a linear ramp between the two correction dimensions.
    def correction_dim(rotations: float) -> float:
        return (
            dim
            * math.log(rope.original_max_position_embeddings / (rotations * 2 * math.pi))
            / (2 * math.log(rope.theta))
        )

    low, high = correction_dim(rope.beta_fast), correction_dim(rope.beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # a zero-width ramp would divide by zero
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1.0 / (rope.theta ** torch.arange(0, dim, 2).float().div(dim))
    interpolation = extrapolation / rope.factor
    keep = 1 - ramp
    return interpolation * (1 - keep) + extrapolation * keep


def attention_factor(rope: RopeConfig) -> float:
    """What cos and sin are multiplied by (yarn and longrope temper the attention's sharpness)."""
    if rope.attention_factor is not None:
        return rope.attention_factor
    if rope.rope_type == "yarn":
        if rope.mscale and rope.mscale_all_dim:
            return _yarn_mscale(rope.factor, rope.mscale) / _yarn_mscale(
                rope.factor, rope.mscale_all_dim
            )
        return _yarn_mscale(rope.factor)
    if rope.rope_type == "longrope":
        factor = rope.factor  # the parser defaults it to max / original positions
        return (
            1.0
            if factor <= 1.0
            else math.sqrt(1 + math.log(factor) / math.log(rope.original_max_position_embeddings))
        )
    return 1.0


def _yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def position_angles(rope: RopeConfig, head_dim: int, max_positions: int) -> torch.Tensor:
    """[max_positions, rotary_dim / 2]: the angle of every frequency at every position."""
    positions = torch.arange(max_positions).float()
    dim = rope.rotary_dim(head_dim)
    if rope.rope_type == "longrope":
        # Per position, for tables and tests; a forward selects per sequence
        # (RotaryEmbedding.cos_sin).
        short, long = longrope_angles(rope, head_dim, max_positions)
        is_long = (positions >= rope.original_max_position_embeddings).unsqueeze(1)
        return torch.where(is_long, long, short)
    if rope.rope_type == "dynamic":
        # NTK-aware: past the model's length, the base grows with the sequence length (p + 1).
        limit = rope.max_position_embeddings
        length = (positions + 1).clamp_min(limit)
        base = rope.theta * ((rope.factor * length / limit) - (rope.factor - 1)) ** (
            dim / (dim - 2)
        )
        inv_freq = 1.0 / (base.unsqueeze(1) ** _exponents(dim))
        return positions.unsqueeze(1) * inv_freq
    return torch.outer(positions, inverse_frequencies(rope, head_dim))


def longrope_angles(
    rope: RopeConfig, head_dim: int, max_positions: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The angles of every position with the short factors and with the long ones."""
    positions = torch.arange(max_positions).float().unsqueeze(1)
    exponents = _exponents(rope.rotary_dim(head_dim))
    short = 1.0 / (torch.tensor(rope.short_factor, dtype=torch.float32) * rope.theta**exponents)
    long = 1.0 / (torch.tensor(rope.long_factor, dtype=torch.float32) * rope.theta**exponents)
    return positions * short, positions * long


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    first, second = x.chunk(2, dim=-1)
    return torch.cat((-second, first), dim=-1)


class RotaryEmbedding(nn.Module):
    def __init__(self, rope: RopeConfig, head_dim: int, max_positions: int):
        super().__init__()
        # longrope: row 0 the short table, row 1 the long one; other types: one table.
        self.long_from = (
            rope.original_max_position_embeddings if rope.rope_type == "longrope" else None
        )
        if torch.empty(0).is_meta:
            # Built on the meta device (engine.weights.loader.build_model), the tables are only
            # placeholders until rebuild_rotary: computing them there runs Python decompositions
            # (seconds).
            size = (2 if self.long_from else 1, max_positions, rope.rotary_dim(head_dim))
            self.register_buffer("cos", torch.empty(size), persistent=False)
            self.register_buffer("sin", torch.empty(size), persistent=False)
            return
        tables = (
            longrope_angles(rope, head_dim, max_positions)
            if self.long_from
            else (position_angles(rope, head_dim, max_positions),)
        )
        angles = torch.stack([torch.cat((a, a), dim=-1) for a in tables])
        scale = attention_factor(rope)
        self.register_buffer("cos", angles.cos() * scale, persistent=False)
        self.register_buffer("sin", angles.sin() * scale, persistent=False)

    def cos_sin(
        self,
        positions: torch.Tensor,
        dtype: torch.dtype,
        last_positions: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for `positions`, shaped to broadcast over heads: [..., 1, rotary_dim].
        Looked up once per forward and shared by every layer. `last_positions` (broadcastable to
        `positions`): the last real position of each token's sequence in this forward, which picks
        longrope's table per sequence; None picks it per position."""
        if self.long_from is None:
            return self.cos[0, positions].unsqueeze(-2).to(dtype), self.sin[0, positions].unsqueeze(
                -2
            ).to(dtype)
        ends = positions if last_positions is None else last_positions
        table = (
            (ends >= self.long_from).long().expand_as(positions)
        )  # a tensor: no host sync, one graph
        return self.cos[table, positions].unsqueeze(-2).to(dtype), self.sin[
            table, positions
        ].unsqueeze(-2).to(dtype)


def apply_rotary(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
    """q, k: [..., heads, head_dim] with leading dims matching the positions of cos/sin. With a
    partial rotary factor only the first cos.shape[-1] dimensions of each head rotate."""
    rotary = cos.shape[-1]
    if rotary == q.shape[-1]:
        return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin
    q_rot, q_pass = q[..., :rotary], q[..., rotary:]
    k_rot, k_pass = k[..., :rotary], k[..., rotary:]
    return (
        torch.cat((q_rot * cos + rotate_half(q_rot) * sin, q_pass), dim=-1),
        torch.cat((k_rot * cos + rotate_half(k_rot) * sin, k_pass), dim=-1),
    )
