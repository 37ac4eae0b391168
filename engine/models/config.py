"""The subset of a Hugging Face config.json that the Llama-family models need."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import ModelLoadError
from engine.layers.rotary import RopeConfig


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    rope: RopeConfig = field(default_factory=RopeConfig)
    sliding_window: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> "ModelConfig":
        architectures = raw.get("architectures") or []
        if not architectures:
            raise ModelLoadError("config.json names no architecture ('architectures' is missing)")
        try:
            return _parse(architectures[0], raw)
        except KeyError as missing:
            raise ModelLoadError(f"config.json lacks the field {missing}") from None


def _parse(architecture: str, raw: dict[str, Any]) -> ModelConfig:
    hidden = raw["hidden_size"]
    heads = raw["num_attention_heads"]
    attention_bias = bool(raw.get("attention_bias", False))
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    window = raw.get("sliding_window")
    if is_qwen2 and not raw.get("use_sliding_window", False):
        window = None  # Qwen2 configs carry a window size they do not use
    return ModelConfig(
        architecture=architecture,
        vocab_size=raw["vocab_size"],
        hidden_size=hidden,
        intermediate_size=raw["intermediate_size"],
        num_layers=raw["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=raw.get("num_key_value_heads") or heads,
        head_dim=raw.get("head_dim") or hidden // heads,
        rms_norm_eps=raw.get("rms_norm_eps", 1e-6),
        max_position_embeddings=raw.get("max_position_embeddings", 4096),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        rope=_parse_rope(raw),
        sliding_window=window,
        eos_token_ids=_as_ids(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
    )


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    # transformers >= 5 writes "rope_parameters"; older configs have rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    theta = params.get("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise ModelLoadError(f"rope type {rope_type!r} is not supported (supported: default, llama3)")
    if rope_type == "default":
        return RopeConfig(theta=theta)
    return RopeConfig(
        theta=theta,
        rope_type="llama3",
        factor=params["factor"],
        low_freq_factor=params["low_freq_factor"],
        high_freq_factor=params["high_freq_factor"],
        original_max_position_embeddings=params["original_max_position_embeddings"],
    )


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(value)
