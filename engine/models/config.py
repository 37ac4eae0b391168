"""The subset of a Hugging Face config.json that our native decoder models need.

One dataclass covers every native family: each family is the Llama decoder plus a few switches
(per-head q/k norms, Gemma's norms and soft-capping, sliding-window layers, sparse MoE blocks).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from engine.errors import ModelLoadError
from engine.layers.rotary import RopeConfig
from engine.models.rope_config import parse_rope

FULL, SLIDING = "full_attention", "sliding_attention"
GEMMA = ("Gemma2ForCausalLM", "Gemma3ForCausalLM")
QWEN_WINDOWED = ("Qwen2ForCausalLM", "Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


@dataclass(frozen=True)
class MoeConfig:
    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool  # renormalize the chosen experts' probabilities to sum to one
    sparse_layers: tuple[bool, ...]  # per layer: a MoE block, or a dense MLP of intermediate_size


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
    sliding_window: int | None = (
        None  # the window of the sliding layers (None: every layer is global)
    )
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    hidden_act: str = "silu"
    layer_types: tuple[str, ...] = ()  # FULL or SLIDING per layer
    qk_norm: bool = False  # Qwen3, Gemma 3: RMSNorm over each head of q and k
    gemma_norms: bool = False  # (1 + weight) norms, scaled embeddings, norms around the MLP too
    query_pre_attn_scalar: float | None = None  # attention scale is its inverse square root
    attn_softcap: float | None = None  # Gemma 2: cap * tanh(score / cap) before the softmax
    final_softcap: float | None = None  # Gemma 2: the same on the logits
    local_rope: RopeConfig | None = None  # Gemma 3: the sliding layers' own rope
    moe: MoeConfig | None = None
    # Embeddings' `dimensions` (Matryoshka truncation): None where config.json does not allow it;
    # the sizes it lists (`matryoshka_dimensions`), or () for any size (`is_matryoshka`), as vLLM
    matryoshka: tuple[int, ...] | None = None
    # A vision-language model: its whole config.json (the fields above are its text model's)
    vision: dict | None = field(default=None, compare=False, hash=False, repr=False)

    @classmethod
    def from_hf(cls, raw: dict[str, Any]) -> ModelConfig:
        architectures = raw.get("architectures") or []
        if not architectures:
            raise ModelLoadError("config.json names no architecture ('architectures' is missing)")
        try:
            if architectures[0] in VISION_LANGUAGE:
                return _parse_vision_language(architectures[0], raw)
            return _parse(architectures[0], raw)
        except KeyError as missing:
            raise ModelLoadError(f"config.json lacks the field {missing}") from None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    def window_of(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == SLIDING else None


# vision-language architecture -> its text model's architecture, by text_config.model_type
VISION_LANGUAGE = (
    "LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Gemma3ForConditionalGeneration",
)
TEXT_MODELS = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen2_5_vl_text": "Qwen2ForCausalLM",  # Qwen2.5-VL's, with multimodal rope
    "qwen2_5_vl": "Qwen2ForCausalLM",  # hub configs: the text model's fields at the top level
    "gemma3_text": "Gemma3ForCausalLM",
}


def _parse_vision_language(architecture: str, raw: dict[str, Any]) -> ModelConfig:
    """The text model's config, naming the vision-language architecture (engine/vision/)."""
    text = raw.get("text_config") or raw  # hub Qwen2.5-VL: the text fields at the top level
    kind = text.get("model_type", "llama")
    if kind not in TEXT_MODELS:
        raise ModelLoadError(
            f"{architecture} with a {kind!r} language model is not supported natively "
            f"(supported: {', '.join(TEXT_MODELS)})"
        )
    parsed = _parse(TEXT_MODELS[kind], {"tie_word_embeddings": False, **text})
    return replace(
        parsed,
        architecture=architecture,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", parsed.tie_word_embeddings)),
        vision=raw,
    )


def _parse(architecture: str, raw: dict[str, Any]) -> ModelConfig:
    hidden = raw["hidden_size"]
    heads = raw["num_attention_heads"]
    attention_bias = bool(raw.get("attention_bias", False))
    is_qwen2 = architecture == "Qwen2ForCausalLM"
    gemma = architecture in GEMMA
    layer_types, window = _layer_types(architecture, raw)
    rope, local_rope = parse_rope(raw, gemma3=architecture == "Gemma3ForCausalLM")
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
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", gemma)),
        qkv_bias=is_qwen2 or attention_bias,
        o_bias=attention_bias and not is_qwen2,
        mlp_bias=bool(raw.get("mlp_bias", False)),
        rope=rope,
        sliding_window=window,
        eos_token_ids=_as_ids(raw.get("eos_token_id")),
        bos_token_id=raw.get("bos_token_id"),
        hidden_act=raw.get("hidden_activation") or raw.get("hidden_act") or "silu",
        layer_types=layer_types,
        qk_norm=architecture in ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM", "Gemma3ForCausalLM"),
        gemma_norms=gemma,
        query_pre_attn_scalar=raw.get("query_pre_attn_scalar") if gemma else None,
        attn_softcap=raw.get("attn_logit_softcapping") if gemma else None,
        final_softcap=raw.get("final_logit_softcapping") if gemma else None,
        local_rope=local_rope,
        moe=_parse_moe(architecture, raw),
        matryoshka=_matryoshka(raw),
    )


def _matryoshka(raw: dict[str, Any]) -> tuple[int, ...] | None:
    """The embedding sizes config.json allows (vLLM reads the same two fields)."""
    sizes = raw.get("matryoshka_dimensions")
    if sizes:
        return tuple(int(size) for size in sizes)
    return () if raw.get("is_matryoshka") else None


def _layer_types(architecture: str, raw: dict[str, Any]) -> tuple[tuple[str, ...], int | None]:
    """Each layer's attention type, and the sliding window (None when no layer slides)."""
    layers, window = raw["num_hidden_layers"], raw.get("sliding_window")
    if architecture in QWEN_WINDOWED and not raw.get("use_sliding_window", False):
        window = None  # Qwen configs carry a window size they do not use
    types = raw.get("layer_types")
    if types is None:
        types = [_default_type(architecture, raw, i) if window else FULL for i in range(layers)]
    unknown = sorted(set(types) - {FULL, SLIDING})
    if unknown:
        raise ModelLoadError(
            f"layer types {unknown} are not supported natively (supported: {FULL}, {SLIDING})"
        )
    if len(types) != layers:
        raise ModelLoadError(f"config.json lists {len(types)} layer_types for {layers} layers")
    if window is None and SLIDING in types:
        raise ModelLoadError("config.json has sliding-window layers but no sliding_window size")
    return tuple(types), window if SLIDING in types else None


def _default_type(architecture: str, raw: dict[str, Any], layer: int) -> str:
    """Layer types of configs written before transformers listed them."""
    if architecture == "Gemma2ForCausalLM":
        return SLIDING if (layer + 1) % 2 else FULL
    if architecture == "Gemma3ForCausalLM":
        return SLIDING if (layer + 1) % raw.get("sliding_window_pattern", 6) else FULL
    if architecture in QWEN_WINDOWED:
        return SLIDING if layer >= raw.get("max_window_layers", 0) else FULL
    return SLIDING  # Mistral, Mixtral, Phi-3: a window means every layer slides


def _parse_moe(architecture: str, raw: dict[str, Any]) -> MoeConfig | None:
    layers = raw["num_hidden_layers"]
    if architecture == "MixtralForCausalLM":
        return MoeConfig(
            raw["num_local_experts"],
            raw["num_experts_per_tok"],
            raw["intermediate_size"],
            True,
            (True,) * layers,
        )
    if architecture == "Qwen3MoeForCausalLM":
        experts = raw.get("num_experts") or raw["num_local_experts"]
        step, dense = raw.get("decoder_sparse_step", 1), set(raw.get("mlp_only_layers") or ())
        sparse = tuple(
            i not in dense and experts > 0 and (i + 1) % step == 0 for i in range(layers)
        )
        return MoeConfig(
            experts,
            raw["num_experts_per_tok"],
            raw["moe_intermediate_size"],
            bool(raw.get("norm_topk_prob", False)),
            sparse,
        )
    return None


def _as_ids(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, int):
        return (value,)
    return tuple(value)
