"""Rope settings from a config.json, in every spelling transformers has written them.

transformers >= 5 writes `rope_parameters` (nested per layer type for Gemma 3); older configs have
`rope_theta` + `rope_scaling`, Gemma 3's `rope_local_base_freq`, and Phi-3's top-level
`original_max_position_embeddings` and `partial_rotary_factor`.
"""

from __future__ import annotations

from typing import Any

from engine.errors import ModelLoadError
from engine.layers.rotary import ROPE_TYPES, RopeConfig

ALIASES = {"su": "longrope", "mrope": "default"}
GEMMA3_THETA = {"full_attention": 1_000_000.0, "sliding_attention": 10_000.0}


def parse_rope(raw: dict[str, Any], gemma3: bool = False) -> tuple[RopeConfig, RopeConfig | None]:
    """(the rope of the global layers, Gemma 3's rope of the sliding layers or None)."""
    params = raw.get("rope_parameters") or {}
    if gemma3:
        nested = params if "full_attention" in params or "sliding_attention" in params else {}
        full = dict(
            nested.get("full_attention")
            or ({} if nested else params or raw.get("rope_scaling") or {})
        )
        full.setdefault("rope_theta", raw.get("rope_theta", GEMMA3_THETA["full_attention"]))
        local = dict(nested.get("sliding_attention") or {})
        local.setdefault(
            "rope_theta", raw.get("rope_local_base_freq", GEMMA3_THETA["sliding_attention"])
        )
        return _rope(full, raw), _rope(local, raw)
    params = dict(params or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    return _rope(params, raw), None


def _rope(params: dict[str, Any], raw: dict[str, Any]) -> RopeConfig:
    rope_type = params.get("rope_type", params.get("type", "default"))
    rope_type = ALIASES.get(rope_type, rope_type)
    if rope_type not in ROPE_TYPES:
        raise ModelLoadError(
            f"rope type {rope_type!r} is not supported (supported: {', '.join(ROPE_TYPES)})"
        )
    max_positions = raw.get("max_position_embeddings", 4096)
    original = params.get(
        "original_max_position_embeddings",
        raw.get("original_max_position_embeddings", max_positions),
    )
    common = dict(
        theta=float(params["rope_theta"]),
        rope_type=rope_type,
        partial_rotary_factor=float(
            params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 1.0))
        ),
        max_position_embeddings=max_positions,
        original_max_position_embeddings=original,
    )
    try:
        return RopeConfig(**common, **_scaling(rope_type, params, max_positions, original))
    except KeyError as missing:
        raise ModelLoadError(
            f"rope type {rope_type!r} needs the field {missing} in config.json"
        ) from None


def _scaling(
    rope_type: str, params: dict[str, Any], max_positions: int, original: int
) -> dict[str, Any]:
    if rope_type in ("linear", "dynamic"):
        return dict(factor=float(params["factor"]))
    if rope_type == "llama3":
        return dict(
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
        )
    if rope_type == "yarn":
        factor = params.get("factor") or max_positions / original
        return dict(
            factor=float(factor),
            beta_fast=float(params.get("beta_fast") or 32),
            beta_slow=float(params.get("beta_slow") or 1),
            mscale=params.get("mscale"),
            mscale_all_dim=params.get("mscale_all_dim"),
            truncate=bool(params.get("truncate", True)),
            attention_factor=params.get("attention_factor"),
        )
    if rope_type == "longrope":
        return dict(
            short_factor=tuple(params["short_factor"]),
            long_factor=tuple(params["long_factor"]),
            attention_factor=params.get("attention_factor"),
            factor=float(params.get("factor") or max_positions / original),
        )
    return {}
