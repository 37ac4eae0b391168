"""Fake optimum.habana.transformers.models.llama.modeling_llama (huggingface/optimum-habana v1.19.1,
commit 1aa991e4bee53652a62ec34c4d5bd2397e5736c6): GaudiLlamaAttention keeps its own K/V cache modules
(`k_cache`, `v_cache`, as upstream's KVCache) and computes attention itself (upstream: FusedSDPA, or
its own matmul softmax off the fused kernel), never looking an attention function up in transformers'
registry: a model built from it bypasses whatever `attn_implementation` names. GaudiLlamaForCausalLM
is the transformers class, built with this attention once adapt_transformers_to_gaudi() has replaced
modeling_llama.LlamaAttention (LlamaDecoderLayer looks the name up in its module when it is built).

The classes' __module__ is set to the upstream module path by tests/fakes/optimum_habana.py, which
also registers this file's module under that name (so its source is what inspect reads).
"""

from __future__ import annotations

import torch
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaForCausalLM,
    apply_rotary_pos_emb,
)


class KVCache(torch.nn.Module):
    """Upstream's own cache: the keys and values of every position so far, concatenated."""

    def __init__(self):
        super().__init__()
        self.cache = None

    def update(self, cur: torch.Tensor) -> torch.Tensor:
        self.cache = cur if self.cache is None else torch.cat((self.cache, cur), dim=-2)
        return self.cache


class GaudiLlamaAttention(LlamaAttention):
    def __init__(self, config, layer_idx: int):
        super().__init__(config, layer_idx)
        self.k_cache, self.v_cache = KVCache(), KVCache()

    def forward(
        self, hidden_states, position_embeddings=None, attention_mask=None, cache=None, **kwargs
    ):
        shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        q = self.q_proj(hidden_states).view(shape).transpose(1, 2)
        k = self.k_proj(hidden_states).view(shape).transpose(1, 2)
        v = self.v_proj(hidden_states).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, *position_embeddings)
        k, v = self.k_cache.update(k), self.v_cache.update(v)
        groups = self.num_key_value_groups
        out = torch.nn.functional.scaled_dot_product_attention(
            q,
            k.repeat_interleave(groups, 1),
            v.repeat_interleave(groups, 1),
            is_causal=q.shape[-2] > 1,
            scale=self.scaling,
        )
        return self.o_proj(out.transpose(1, 2).reshape(*hidden_states.shape[:-1], -1)), None


class GaudiLlamaForCausalLM(LlamaForCausalLM):
    pass
