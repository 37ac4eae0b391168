"""Build the transformers fallback for a model directory, or refuse it with the reason.

Refused: encoder-decoder and vision models, configs transformers cannot build, and causal LMs
whose attention does not go through transformers' attention interface in every layer: those would
keep their own cache and never see ours. That is observed with a probe forward at load (whatever a
class's `_supports_attention_backend` flag says: StableLM's lacks it, yet its modules call the
interface), and the probe's calls give the cache geometry the modules really use.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from engine.errors import ModelLoadError
from engine.models.config import FULL, ModelConfig
from engine.models.fallback import (
    ATTENTION_NAME,
    AttentionCall,
    TransformersCausalLM,
    probe_attention,
    register_attention,
)
from engine.weights.placement import Placement

log = logging.getLogger(__name__)


def causal_lm_class(model_dir: Path):
    """(transformers config, the causal LM class it builds) or a ModelLoadError naming why not."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        hf_config = AutoConfig.from_pretrained(model_dir)
    except Exception as err:  # transformers raises many types for a config it cannot read
        raise ModelLoadError(
            f"transformers cannot build a model from {model_dir / 'config.json'}: {_one_line(err)}"
        ) from None
    kind = hf_config.model_type
    if getattr(hf_config, "is_encoder_decoder", False):
        raise ModelLoadError(
            f"model type {kind!r} is an encoder-decoder model: only decoder-only causal LMs are "
            "served"
        )
    if getattr(hf_config, "vision_config", None) is not None:
        raise ModelLoadError(
            f"model type {kind!r} is a vision-language model: only text decoders are served"
        )
    try:
        cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(hf_config)]
    except KeyError:
        raise ModelLoadError(
            f"model type {kind!r} has no causal language model in transformers "
            "(an encoder, vision or audio model?)"
        ) from None
    return hf_config, cls


def load_transformers_model(model_dir: Path, placement: Placement, prepare=None):
    """`prepare(cls)`: the device adapter's hook, which may adapt transformers and pick the class to
    build."""
    hf_config, cls = causal_lm_class(model_dir)
    if prepare is not None:
        cls = prepare(cls)
    register_attention()
    dtype, device, parallel = placement.dtype, placement.device, placement.parallel
    options = dict(dtype=dtype, attn_implementation=ATTENTION_NAME)
    if parallel.world_size > 1:
        if not getattr(hf_config, "base_model_tp_plan", None):
            raise ModelLoadError(
                f"{cls.__name__} declares no tensor-parallel plan (base_model_tp_plan): "
                "serve it on one shard, or use a natively implemented architecture"
            )
        options["tp_plan"] = "auto"
    try:
        hf_model = cls.from_pretrained(model_dir, **options)
    except Exception as err:
        raise ModelLoadError(
            f"transformers cannot load {cls.__name__} from {model_dir}: {_one_line(err)}"
        ) from None
    hf_model = hf_model.to(device).eval()
    config = fallback_config(hf_config, cls.__name__)
    name = cls.__name__
    layers, kv_heads, head_dim = observed_geometry(hf_model, device, name, config.num_layers)
    world = parallel.world_size
    sharded = local_kv_heads(hf_config, config.num_kv_heads, world) != config.num_kv_heads
    config = replace(
        config,
        num_layers=layers,
        head_dim=head_dim,
        num_kv_heads=kv_heads * world if sharded else kv_heads,
    )
    log.info(
        "%s runs through the transformers fallback (attention: bucketserve paged)", cls.__name__
    )
    return TransformersCausalLM(hf_model, config, kv_heads), config


def observed_geometry(
    hf_model, device: torch.device, name: str, num_layers: int
) -> tuple[int, int, int]:
    """(layers, this rank's kv heads, head size) as a probe forward sees the attention modules
    call ours, or a ModelLoadError when any layer attends outside transformers' interface."""
    try:
        calls = probe_attention(hf_model, device)
    except Exception as err:  # the model's own code failed on a two-token forward
        raise ModelLoadError(
            f"{name}: the probe forward through transformers failed: {_one_line(err)}"
        ) from None
    return attention_geometry(calls, name, num_layers)


def attention_geometry(
    calls: list[AttentionCall], name: str, num_layers: int
) -> tuple[int, int, int]:
    if not calls:
        raise ModelLoadError(
            f"{name} does not run its attention through transformers' attention "
            "interface (a probe forward made no call into it), so it cannot use "
            "the paged KV cache"
        )
    layers = sorted(call.layer for call in calls if call.layer is not None)
    if len(layers) != len(calls) or layers != list(range(num_layers)):
        seen = ", ".join(str(call.layer) for call in calls)
        raise ModelLoadError(
            f"{name} calls transformers' attention interface from layers "
            f"[{seen}], not once from each of its {num_layers} layers: the others "
            "would attend outside the paged KV cache"
        )
    shapes = {(call.kv_heads, call.head_dim, call.value_dim) for call in calls}
    if len(shapes) > 1:
        raise ModelLoadError(
            f"{name}'s attention layers differ in kv heads or head size "
            f"{sorted(shapes)}: the paged KV cache holds one geometry"
        )
    kv_heads, head_dim, value_dim = shapes.pop()
    if head_dim != value_dim:
        raise ModelLoadError(
            f"{name}'s keys and values differ in head size ({head_dim} vs "
            f"{value_dim}): the paged KV cache holds one head size"
        )
    return num_layers, kv_heads, head_dim


def _one_line(err: Exception) -> str:
    return " ".join(
        str(err).split()
    )  # transformers' messages span lines; ours are one `error:` line


def local_kv_heads(hf_config, kv_heads: int, world_size: int) -> int:
    """The kv heads each rank's attention sees (and caches): split when the TP plan shards k_proj
    column-wise, all of them when it gathers k_proj's output (Olmo2) or leaves attention
    replicated."""
    plan = getattr(hf_config, "base_model_tp_plan", None) or {}
    styles = [style for name, style in plan.items() if name.endswith(".k_proj")]
    return kv_heads // world_size if world_size > 1 and styles == ["colwise"] else kv_heads


def fallback_config(hf_config, architecture: str) -> ModelConfig:
    """The fields the engine itself needs (cache geometry, limits, stop tokens) from a transformers
    config."""
    text = hf_config.get_text_config()
    hidden, heads = text.hidden_size, text.num_attention_heads
    layers = text.num_hidden_layers
    types = tuple(getattr(text, "layer_types", None) or (FULL,) * layers)
    eos = getattr(text, "eos_token_id", None)
    return ModelConfig(
        architecture=architecture,
        vocab_size=text.vocab_size,
        hidden_size=hidden,
        intermediate_size=getattr(text, "intermediate_size", 0) or 0,
        num_layers=layers,
        num_heads=heads,
        num_kv_heads=getattr(text, "num_key_value_heads", None) or heads,
        head_dim=getattr(text, "head_dim", None) or hidden // heads,
        rms_norm_eps=getattr(text, "rms_norm_eps", 1e-6) or 1e-6,
        max_position_embeddings=getattr(text, "max_position_embeddings", 4096) or 4096,
        tie_word_embeddings=bool(getattr(text, "tie_word_embeddings", False)),
        qkv_bias=False,
        o_bias=False,
        mlp_bias=False,
        sliding_window=getattr(text, "sliding_window", None),
        layer_types=types,
        eos_token_ids=() if eos is None else ((eos,) if isinstance(eos, int) else tuple(eos)),
        bos_token_id=getattr(text, "bos_token_id", None),
    )
