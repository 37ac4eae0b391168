"""Attention over the paged KV cache.

Every forward first writes the new keys and values into the cache by slot, then attends:
prefill over the padded prompt batch (prompt.py), decode over a flat list of KV blocks (flat.py).
Imports nothing else of the engine: devices may register faster kernels for it (backend.py).
"""
from typing import NamedTuple

import torch

from engine.attention.backend import active_backend
from engine.attention.flat import flat_masked


class PrefillMetadata(NamedTuple):
    slots: torch.Tensor  # [batch * seq] cache slot of every token; padding writes to block 0


class DecodeMetadata(NamedTuple):
    slots: torch.Tensor          # [batch] cache slot of each row's new token
    block_list: torch.Tensor     # [num_blocks] KV blocks of all rows, concatenated
    block_mapping: torch.Tensor  # [num_blocks, batch] one-hot owner row (all zero for padding)
    block_groups: torch.Tensor   # [num_blocks] owner row (0 for padding blocks)
    block_bias: torch.Tensor     # [num_blocks, block_size] 0 where valid, a large negative past usage
    block_masked: torch.Tensor | None = None  # derived once per forward by prepare_metadata


AttentionMetadata = PrefillMetadata | DecodeMetadata


def prepare_metadata(meta: AttentionMetadata, kv_heads: int) -> AttentionMetadata:
    """Derive, once per forward, what every layer's attention would otherwise recompute."""
    if isinstance(meta, DecodeMetadata) and meta.block_masked is None:
        return meta._replace(block_masked=flat_masked(meta.block_bias, kv_heads))
    return meta


def write_kv(cache: tuple[torch.Tensor, torch.Tensor], slots, k, v) -> None:
    key_cache, value_cache = cache
    key_cache.index_copy_(0, slots, k.reshape(-1, *key_cache.shape[1:]))
    value_cache.index_copy_(0, slots, v.reshape(-1, *value_cache.shape[1:]))


def attention(q, k, v, cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [..., heads, head_dim]; k, v: [..., kv_heads, head_dim]. Returns q's shape."""
    write_kv(cache, meta.slots, k, v)
    kernels = active_backend()  # pure torch unless the device adapter supplied its own
    if isinstance(meta, PrefillMetadata):
        return kernels.prefill(q, k, v, scale)
    key_cache, value_cache = cache
    return kernels.decode(
        q, key_cache, value_cache, meta.block_list, meta.block_mapping, meta.block_groups, meta.block_bias, scale,
        meta.block_masked,
    )
