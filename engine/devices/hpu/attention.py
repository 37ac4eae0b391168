"""Gaudi attention kernels behind our attention contracts: Habana's FusedSDPA for prefill (with
the cached context folded in, for prefix-cache hits and later chunks) and vllm-hpu-extension's
flat_pa (any supported release, engine/devices/hpu/ops.py) for decode. Whatever is missing runs in
pure torch, said once as a WARNING with the reason."""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from functools import partial

import torch

from engine.attention.backend import AttentionBackend
from engine.attention.context import context_mask
from engine.attention.flat import flat_attention
from engine.attention.prompt import prompt_attention
from engine.devices.hpu.ops import FlatPA, load_flat_pa

log = logging.getLogger(__name__)
_told: set[str] = set()


@dataclass
class HPUKernels:
    backend: AttentionBackend | None  # None: pure torch for both
    flat_pa: FlatPA | None

    def configure(self, model) -> None:
        """Before each forward: the extension's runtime config needs the model type (set once),
        and what the layers share is derived afresh (the runner may refill the same buffers)."""
        if self.flat_pa is not None:
            self.flat_pa.configure(model_type(model))
            self.flat_pa.new_forward()


def model_type(model) -> str:
    """HF's model_type, which the extension's flags read (qwen2: fp32 softmax). The transformers
    fallback has transformers' own config; a native model's comes from its architecture name
    ("Qwen2ForCausalLM" -> "qwen2", "Qwen2MoeForCausalLM" -> "qwen2_moe"). A wrapper of the model
    (the runner's PromptScorer) holds it as `scored`."""
    model = getattr(model, "scored", model)
    hf_config = getattr(getattr(model, "hf_model", None), "config", None)
    for config in (hf_config, getattr(model, "config", None)):
        kind = getattr(config, "model_type", None)
        if isinstance(kind, str) and kind:
            return kind
    architecture = getattr(getattr(model, "config", None), "architecture", "") or ""
    name = architecture.removeprefix("Gaudi").removesuffix("ForCausalLM")
    return re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", name).lower() or "unknown"


def load_kernels() -> HPUKernels:
    fused = load_fused_sdpa()
    flat_pa, reasons = load_flat_pa()
    if flat_pa is None:
        _warn_once(
            "decode attention runs in pure torch: no usable vllm-hpu-extension ("
            + "; ".join(reasons)
            + ")"
        )
    if fused is None and flat_pa is None:
        return HPUKernels(None, None)
    prefill = partial(fused_prefill, fused) if fused else prompt_attention
    decode = partial(flat_pa_decode, flat_pa) if flat_pa else flat_attention
    context = partial(fused_context, fused) if fused else None
    name = "+".join(
        filter(
            None, ["fusedsdpa" if fused else "", f"flat_pa {flat_pa.release}" if flat_pa else ""]
        )
    )
    _info_once(f"attention: {name}")
    return HPUKernels(AttentionBackend(name, prefill, decode, context), flat_pa)


def load_fused_sdpa():
    try:
        from habana_frameworks.torch.hpex.kernels import FusedSDPA
    except ImportError as err:
        _warn_once(f"prefill attention runs in pure torch: FusedSDPA is not importable ({err})")
        return None
    return FusedSDPA


def fused_prefill(
    fused, q, k, v, scale: float, lengths: torch.Tensor | None = None
) -> torch.Tensor:
    """q: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim], right-padded prompts (the
    kernel takes grouped kv heads as they are). `lengths`, each row's real length, lets the kernel
    skip the padding's work, as TGI passes valid_seq_lengths; without them every row counts as full
    (causality alone keeps real tokens from seeing the padding after them)."""
    batch, seq = q.shape[:2]
    if lengths is None:
        lengths = torch.full((batch,), seq, dtype=torch.int32, device=q.device)
    return _fused_apply(fused, q, k, v, None, True, scale, lengths.to(torch.int32))


def fused_context(
    fused, q, k, v, key_cache, value_cache, context_slots, context_lens, scale: float
) -> torch.Tensor:
    """context_attention's contract through FusedSDPA, as vllm-hpu-extension folds the past KV in
    (ops.py `_get_context`: the context's keys and values fetched from the cache, put before the
    new ones; `_fsdpa_prompt_attention`: an additive bias instead of causality and lengths, which
    the kernel does not take together): q [batch, seq, heads, dim], k and v the new tokens'."""
    batch, seq = q.shape[:2]
    past = context_slots.reshape(-1)
    keys = torch.cat([key_cache.index_select(0, past).view(batch, -1, *k.shape[2:]), k], dim=1)
    values = torch.cat([value_cache.index_select(0, past).view(batch, -1, *v.shape[2:]), v], dim=1)
    allowed = context_mask(context_slots.shape[1], seq, context_lens, None)
    bias = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device)
    bias = bias.masked_fill(~allowed, -math.inf).unsqueeze(1)  # [batch, 1, seq, context + seq]
    return _fused_apply(fused, q, keys, values, bias, False, scale, None)


def _fused_apply(fused, q, k, v, mask, causal: bool, scale: float, lengths) -> torch.Tensor:
    """FusedSDPA over [batch, seq, heads, dim] tensors, no dropout, the default softmax mode, right
    padding. FusedSDPA is an autograd Function: its arguments are positional only."""
    out = fused.apply(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        mask,
        0.0,
        causal,
        scale,
        "None",
        None,
        lengths,
        "right",
    )
    return out.transpose(1, 2)


def flat_pa_decode(
    flat_pa: FlatPA,
    q,
    key_cache,
    value_cache,
    block_list,
    block_mapping,
    block_groups,
    block_bias,
    scale,
    masked=None,
) -> torch.Tensor:
    """flat_attention's contract (`masked` is pure torch's own precomputation, unused here)."""
    return flat_pa(
        q, key_cache, value_cache, block_list, block_mapping, block_groups, block_bias, scale
    )


def _warn_once(message: str) -> None:
    if message not in _told:
        _told.add(message)
        log.warning(message)


def _info_once(message: str) -> None:
    if message not in _told:
        _told.add(message)
        log.info(message)
