"""Prefill with context: new tokens attend to KV already in the paged cache, then to each other
causally.

A prefix-cache hit or the next chunk of a chunked prompt computes only its new tokens; the tokens
before them (the context) are read from the cache by slot. Everything the kernel needs is a tensor
(context slots, context lengths), so one graph serves every batch of a
(batch, new tokens, context blocks) bucket. Pure torch ops: it runs on every device path.
"""

import torch
import torch.nn.functional as F

from engine.attention.prompt import same_image


def context_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    context_slots: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """q: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim] (the new tokens,
    right-padded); key_cache/value_cache: [slots, kv_heads, dim]; context_slots: [batch, context]
    the cache slot of each context token (padding: a slot of the reserved block); context_lens:
    [batch] tokens of context per row (0 for a row without one). Returns q's shape. Row r's new
    token i sits at position context_lens[r] + i. `groups` [batch, seq] (Gemma 3): the image of each
    new token (-1 for text); a new token of an image sees the image's later new tokens too (its
    earlier ones, new or in context, it sees causally: a chunk never ends inside an image,
    engine/serving/chunks.py)."""
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    keys = torch.cat(
        [_gather(key_cache, context_slots), k], dim=1
    )  # [batch, ctx + seq, kv_heads, dim]
    values = torch.cat([_gather(value_cache, context_slots), v], dim=1)
    allowed = context_mask(
        context_slots.shape[1], seq, context_lens, window, groups
    )  # [batch, seq, ctx + seq]
    if softcap is not None:
        return _capped(q, keys, values, allowed, scale, softcap)
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        keys.transpose(1, 2),
        values.transpose(1, 2),
        attn_mask=allowed.unsqueeze(1),
        scale=scale,
        enable_gqa=heads != kv_heads,
    )
    return out.transpose(1, 2)


def _gather(cache: torch.Tensor, context_slots: torch.Tensor) -> torch.Tensor:
    """[batch, context, kv_heads, dim]: each row's context tokens in order, read by slot."""
    batch, context = context_slots.shape
    return cache.index_select(0, context_slots.reshape(-1)).view(batch, context, *cache.shape[1:])


def context_mask(
    context: int, seq: int, context_lens: torch.Tensor, window: int | None, groups=None
) -> torch.Tensor:
    """[batch, seq, context + seq] True where new token i may see a key: a context key j when
    j < context_lens (the rest is the block table's padding), a new key j' when j' <= i; with a
    window, only keys less than `window` positions behind the query."""
    device = context_lens.device
    rows = torch.arange(seq, device=device).view(1, seq, 1)
    ctx_cols = torch.arange(context, device=device).view(1, 1, context)
    new_cols = torch.arange(seq, device=device).view(1, 1, seq)
    lens = context_lens.view(-1, 1, 1)
    see_context = (ctx_cols < lens).expand(-1, seq, -1)
    see_new = (new_cols <= rows).expand(context_lens.shape[0], -1, -1)
    if groups is not None:  # an image's tokens see each other both ways
        see_new = see_new | same_image(groups, groups)
    if window is not None:
        query_pos = lens + rows
        see_context = see_context & (query_pos - ctx_cols < window)
        see_new = see_new & (rows - new_cols < window)
    return torch.cat([see_context, see_new], dim=2)


def _capped(q, keys, values, allowed, scale: float, softcap: float) -> torch.Tensor:
    """Explicit scores, since SDPA cannot cap them (Gemma 2); query heads grouped per kv head."""
    batch, seq, heads, dim = q.shape
    kv_heads, total = keys.shape[2], keys.shape[1]
    grouped = q.view(batch, seq, kv_heads, heads // kv_heads, dim).permute(
        0, 2, 3, 1, 4
    )  # [b, kvh, g, s, d]
    scores = (grouped @ keys.permute(0, 2, 3, 1).unsqueeze(2)) * scale  # [b, kvh, g, s, total]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(
        ~allowed.view(batch, 1, 1, seq, total), torch.finfo(scores.dtype).min
    )
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = probs @ values.permute(0, 2, 1, 3).unsqueeze(2)  # [b, kvh, g, s, d]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, seq, heads, dim)
