"""Attention over the paged KV cache.

Every forward first writes the new keys and values into the cache by slot, then attends:
prefill over the padded prompt batch (prompt.py), prefill that continues cached context
(context.py), decode over a flat list of KV blocks (flat.py), or, with the pure-torch kernels, over
each row's blocks padded to the longest row in one fused call (rows.py: eager CPU, and any batch-1
bucket). Imports nothing else of the engine: devices may register faster kernels for it
(backend.py).
"""

from typing import NamedTuple

import torch

from engine.attention.backend import TORCH, active_backend
from engine.attention.context import context_attention
from engine.attention.flat import flat_attention, flat_masked
from engine.attention.prompt import prompt_attention
from engine.attention.rows import row_attention


class PrefillMetadata(NamedTuple):
    slots: torch.Tensor  # [batch * seq] cache slot of every token; padding writes to block 0
    seq_lens: torch.Tensor | None = (
        None  # [batch] real prompt lengths (padding rows: 1), for kernels that skip padding
    )
    # Prefill with context (prefix-cache hit, or a later chunk): what the new tokens continue.
    context_slots: torch.Tensor | None = (
        None  # [batch, context tokens] cache slot of each context token
    )
    context_lens: torch.Tensor | None = None  # [batch] context tokens of each row (0: none)
    # Gemma 3's images: [batch, seq] the image of each new token (counted per row from 0; -1 for
    # text), whose tokens attend to each other both ways (engine/attention/prompt.py)
    image_groups: torch.Tensor | None = None


class DecodeMetadata(NamedTuple):
    slots: torch.Tensor  # [batch] cache slot of each row's new token
    block_list: torch.Tensor  # [num_blocks] KV blocks of all rows, concatenated
    block_mapping: torch.Tensor  # [num_blocks, batch] one-hot owner row (all zero for padding)
    block_groups: torch.Tensor  # [num_blocks] owner row (0 for padding blocks)
    block_bias: torch.Tensor  # [num_blocks, block_size] 0 where valid, a large negative past usage
    block_masked: torch.Tensor | None = None  # derived once per forward by prepare_metadata
    # Where nothing is compiled (rows.py): each row's blocks padded to the longest row, and their
    # bias.
    row_table: torch.Tensor | None = None  # [batch, width]
    row_bias: torch.Tensor | None = (
        None  # [batch, width * block_size] 0 where valid, a large negative past
    )
    row_attention: tuple | None = (
        None  # (table, mask) derived by prepare_metadata for the torch kernels
    )


AttentionMetadata = PrefillMetadata | DecodeMetadata


def prepare_metadata(meta: AttentionMetadata, kv_heads: int) -> AttentionMetadata:
    """Derive, once per forward, what every layer's attention would otherwise recompute."""
    if not isinstance(meta, DecodeMetadata) or meta.block_masked is not None:
        return meta
    meta = meta._replace(block_masked=flat_masked(meta.block_bias, kv_heads))
    if active_backend() is not TORCH:  # a device's own decode kernel is never bypassed
        return meta
    batch = meta.slots.shape[0]
    table, bias = meta.row_table, meta.row_bias
    if (
        table is None and batch == 1
    ):  # a lone row: the flat block list is its table, the block bias its mask
        table, bias = meta.block_list.view(1, -1), meta.block_bias.reshape(1, -1)
    if table is not None:
        meta = meta._replace(row_attention=(table, bias.view(batch, 1, 1, -1)))
    return meta


def windowed_metadata(
    meta: DecodeMetadata, positions: torch.Tensor, window: int, kv_heads: int
) -> DecodeMetadata:
    """The decode metadata of sliding-window layers: the block bias also masks every cached token
    that lies `window` or more positions behind its row's new token (transformers' rule: a query at
    q sees keys k with q - window < k <= q). Shared by every sliding layer of the forward.

    A block's first position is derived from the flat block list, whose blocks are each row's own
    blocks in sequence order (engine.attention.flat.flat_block_tensors): all tensors, no scalars."""
    num_blocks, block_size = meta.block_bias.shape
    groups = meta.block_groups
    index = torch.arange(num_blocks, device=groups.device)
    first = torch.full((positions.shape[0],), num_blocks, dtype=index.dtype, device=groups.device)
    first = first.scatter_reduce(0, groups, index, reduce="amin")
    start = (index - first.index_select(0, groups)) * block_size
    token_positions = start.unsqueeze(1) + torch.arange(block_size, device=groups.device)
    too_old = token_positions <= (positions.index_select(0, groups) - window).unsqueeze(1)
    shut = torch.finfo(meta.block_bias.dtype).min / 2
    meta = meta._replace(
        block_bias=meta.block_bias.masked_fill(too_old, shut), block_masked=None, row_attention=None
    )
    if meta.row_bias is not None:  # a row's padded position j holds its token j
        span = torch.arange(meta.row_bias.shape[1], device=groups.device)
        meta = meta._replace(
            row_bias=meta.row_bias.masked_fill(span <= (positions - window).unsqueeze(1), shut)
        )
    return prepare_metadata(meta, kv_heads)


def write_kv(cache: tuple[torch.Tensor, torch.Tensor], slots, k, v) -> None:
    key_cache, value_cache = cache
    key_cache.index_copy_(0, slots, k.reshape(-1, *key_cache.shape[1:]))
    value_cache.index_copy_(0, slots, v.reshape(-1, *value_cache.shape[1:]))


def attention(
    q,
    k,
    v,
    cache,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """q: [..., heads, head_dim]; k, v: [..., kv_heads, head_dim]. Returns q's shape.

    `window`: a sliding-window layer's window, applied here in prefill; in decode the caller passes
    the windowed metadata (windowed_metadata). `softcap`: Gemma 2's tanh cap on the scores. Device
    kernels take neither a window nor a cap (nor Gemma 3's image mask), so such prefills, and capped
    decodes, run the pure-torch kernels; a windowed decode keeps the device's kernel, the window
    being in the block bias."""
    write_kv(cache, meta.slots, k, v)
    kernels = active_backend()  # pure torch unless the device adapter supplied its own
    if isinstance(meta, PrefillMetadata):
        groups = meta.image_groups  # device kernels take no such mask either
        plain = window is None and softcap is None and groups is None
        if meta.context_slots is not None:
            context = (meta.context_slots, meta.context_lens, scale)
            if kernels.context is None or not plain:
                return context_attention(q, k, v, *cache, *context, window, softcap, groups)
            return kernels.context(q, k, v, *cache, *context)
        if not plain:
            return prompt_attention(q, k, v, scale, window=window, softcap=softcap, groups=groups)
        return kernels.prefill(q, k, v, scale, lengths=meta.seq_lens)
    key_cache, value_cache = cache
    if (
        meta.row_attention is not None and softcap is None
    ):  # set only when the pure-torch kernels run
        return row_attention(q, key_cache, value_cache, *meta.row_attention, scale)
    args = (
        q,
        key_cache,
        value_cache,
        meta.block_list,
        meta.block_mapping,
        meta.block_groups,
        meta.block_bias,
        scale,
        meta.block_masked,
    )
    if softcap is not None:
        return flat_attention(*args, softcap=softcap)
    return kernels.decode(*args)
