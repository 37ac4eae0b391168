"""The prefill forward that answers embeddings (`/v1/embeddings`): each row's final hidden state,
after the model's final norm, pooled and L2-normalized inside the bucket's graph.

It runs at the shapes of the plain prefill buckets (`("embed", bucket)`, warmed beside them), so
serving meets no new shape; its output is [bucket rows, hidden] float32, not logits. The pooling
is --pooling: `last` (the last real token's state, vLLM's default for decoder models such as
Qwen3-Embedding) or `mean` (the average over each row's real tokens, sentence-transformers' mean
pooling of the same states).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

POOLINGS = ("last", "mean")


def can_pool(model) -> str | None:
    """Why `model` cannot answer embeddings (None: it can). The pooler runs the native decoder's
    layers and final norm; the transformers fallback, pipeline stages and vision-language models
    (whose prefill takes image inputs) have no such path yet."""
    if not (hasattr(model, "run_layers") and hasattr(model, "norm")):
        return "embeddings are served by native model implementations only"
    if getattr(model, "stage", None) is not None:
        return "embeddings are not served by pipeline-parallel shards yet"
    if getattr(model, "takes_images", False) or getattr(model, "takes_mrope", False):
        return "embeddings are not served by vision-language models yet"
    return None


class Pooler(torch.nn.Module):
    """`model`'s prefill forward with the pooled, normalized final hidden states as its output."""

    def __init__(self, model, pooling: str):
        super().__init__()
        if pooling not in POOLINGS:
            raise ValueError(f"pooling {pooling!r}: choose from {', '.join(POOLINGS)}")
        self.pooled, self.pooling = model, pooling

    def forward(self, input_ids, positions, meta, last, lora_index=None):
        model = self.pooled
        hidden = model.run_layers(model.embed(input_ids), positions, meta, lora_index)
        states = model.norm(hidden).reshape(-1, model.config.hidden_size)
        if self.pooling == "last":
            pooled = states.index_select(0, last).float()
        else:  # padding sits after each row's real tokens; seq_lens counts them
            rows, width = input_ids.shape
            real = torch.arange(width, device=states.device) < meta.seq_lens.unsqueeze(1)
            summed = (states.view(rows, width, -1).float() * real.unsqueeze(-1)).sum(dim=1)
            pooled = summed / meta.seq_lens.unsqueeze(1).float()
        return F.normalize(pooled, dim=-1)
