"""The transformers fallback: any decoder-only causal LM that transformers can build, on our
paged KV cache, in our warmed buckets.

transformers builds the model with `attn_implementation="bucketserve"`, a function registered with
its AttentionInterface. Every attention layer then calls us with its q, k, v: we write k and v into
our paged cache by slot and attend with the same kernels as the native models (prompt attention in
prefill, flat paged attention in decode). The model is called with position ids and no attention
mask or cache of its own; the step's slots and block tables reach the attention function as tensors
through the step context below (forwards are serialized by the shard's device lock).

Whether a model really attends through that interface is observed, not read from a class flag: a
probe forward at load records every call into our function (probe_attention), and the calls give
the cache's geometry as the modules really compute it (a config may carry stray fields, such as a
num_key_value_heads that GPT-NeoX never reads).
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import nn

from engine.attention import (
    AttentionMetadata,
    DecodeMetadata,
    attention,
    prepare_metadata,
    windowed_metadata,
)

ATTENTION_NAME = "bucketserve"


@dataclass
class _Step:
    meta: AttentionMetadata
    positions: torch.Tensor
    caches: list
    kv_heads: int
    windowed: dict = field(
        default_factory=dict
    )  # window -> decode metadata with that window in its bias

    def decode_meta(self, window: int | None) -> DecodeMetadata:
        if window is None:
            return self.meta
        if window not in self.windowed:
            self.windowed[window] = windowed_metadata(
                self.meta, self.positions, window, self.kv_heads
            )
        return self.windowed[window]


@dataclass(frozen=True)
class AttentionCall:
    """One call into our attention function, as the probe saw it."""

    layer: int | None  # the calling module's layer_idx: its KV cache
    heads: int
    kv_heads: int
    head_dim: int
    value_dim: int


class _Probe:
    """Stands in for a step during the probe forward: records each call and attends nothing."""

    def __init__(self):
        self.calls: list[AttentionCall] = []

    def attend(self, module, query, key, value):
        layer = getattr(module, "layer_idx", None)
        self.calls.append(
            AttentionCall(layer, query.shape[1], key.shape[1], key.shape[-1], value.shape[-1])
        )
        batch, heads, seq = query.shape[:3]
        return query.new_zeros(batch, seq, heads, value.shape[-1]), None


_current: _Step | _Probe | None = None


@contextmanager
def _step(step: _Step | _Probe):
    global _current
    previous, _current = _current, step
    try:
        yield
    finally:
        _current = previous


def bucketserve_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    scaling=None,
    dropout=0.0,
    sliding_window=None,
    softcap=None,
    **kwargs,
):
    """transformers' attention contract: query [batch, heads, seq, dim], key/value [batch, kv_heads,
    seq, dim]; returns ([batch, seq, heads, dim], no weights)."""
    step = _current
    if step is None:
        raise RuntimeError("the bucketserve attention runs only inside a bucketserve forward")
    if isinstance(step, _Probe):
        return step.attend(module, query, key, value)
    cache = step.caches[module.layer_idx]
    q, k, v = query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    if isinstance(step.meta, DecodeMetadata):  # one token per row
        out = attention(
            q[:, 0], k[:, 0], v[:, 0], cache, step.decode_meta(sliding_window), scale, None, softcap
        )
        return out.unsqueeze(1), None
    return attention(q, k, v, cache, step.meta, scale, sliding_window, softcap), None


def register_attention() -> None:
    """Make `attn_implementation="bucketserve"` known to transformers (idempotent)."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, bucketserve_attention)


def probe_attention(hf_model, device: torch.device, tokens: int = 2) -> list[AttentionCall]:
    """The calls a `tokens`-long forward of `hf_model` makes into our attention function; none
    when its attention bypasses transformers' interface (a model that attends by itself)."""
    probe = _Probe()
    ids = torch.zeros(1, tokens, dtype=torch.long, device=device)
    positions = torch.arange(tokens, device=device).view(1, -1)
    with torch.inference_mode(), _step(probe):
        hf_model(input_ids=ids, position_ids=positions, use_cache=False, logits_to_keep=1)
    return probe.calls


class TransformersCausalLM(nn.Module):
    """A transformers causal LM behind the forward contract of our native models."""

    implementation = "transformers"

    def __init__(self, hf_model, config, local_kv_heads: int):
        super().__init__()
        self.hf_model, self.config, self.local_kv_heads = hf_model, config, local_kv_heads
        self.caches: list | None = None
        self.lora_set = None  # adapters are served by the native models only

    def forward(
        self, input_ids, positions, meta: AttentionMetadata, logits_indices, lora_index=None
    ) -> torch.Tensor:
        decode = input_ids.dim() == 1
        ids = input_ids.view(-1, 1) if decode else input_ids
        pos = positions.view(-1, 1) if decode else positions
        meta = prepare_metadata(meta, self.local_kv_heads)
        keep = self._logits_to_keep(ids, logits_indices, decode)
        with _step(_Step(meta, positions, self.caches, self.local_kv_heads)):
            logits = self.hf_model(
                input_ids=ids, position_ids=pos, use_cache=False, logits_to_keep=keep
            ).logits
        if isinstance(keep, torch.Tensor):  # one position per row, each row's own
            return logits[:, 0].float()
        return logits.reshape(-1, logits.shape[-1]).index_select(0, logits_indices).float()

    @staticmethod
    def _logits_to_keep(ids, logits_indices, decode: bool):
        """Project only the positions whose logits are asked for: each row's last token in a
        prefill (a [rows, 1] tensor of positions), everything in decode or when every position
        is."""
        if decode or logits_indices.numel() == ids.numel():
            return 0
        return (logits_indices % ids.shape[1]).view(-1, 1)

    def bind_kv_cache(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        self.caches = caches
