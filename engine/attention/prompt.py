import torch
import torch.nn.functional as F


def prompt_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
    lengths: torch.Tensor | None = None,
    groups: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention over a right-padded [batch, seq] prompt batch.

    Prompts are padded on the right, so the causal mask alone keeps every real token from seeing
    padding: padding only ever sits at later positions. Padded rows compute garbage that the
    runner discards. q: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim].
    `window`: a sliding-window layer sees only keys less than `window` positions back (prompts start
    at position 0, so positions are the column indices). `softcap`: Gemma 2's capped scores.
    `lengths` (each row's real length) is not needed here: the causal mask already keeps every real
    token from the padding; kernels that can skip the padding's work take it (FusedSDPA).
    `groups` ([batch, seq], Gemma 3): the image of each token (-1 for text); the tokens of one
    image also see each other's later tokens (padding is text: it stays unseen).
    """
    if softcap is not None:
        allowed = _allowed(q.shape[1], window, q.device, groups)
        return _capped_attention(q, k, v, scale, allowed, softcap)
    mask = None
    if window is not None or groups is not None:
        mask = _allowed(q.shape[1], window, q.device, groups)
        mask = mask if groups is None else mask.unsqueeze(1)  # [batch, 1, seq, seq]
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        attn_mask=mask,
        is_causal=mask is None,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)


def _allowed(seq: int, window: int | None, device, groups=None) -> torch.Tensor:
    """[seq, seq] True where query i may see key j: j <= i, and i - j < window for a window.
    With `groups` [batch, seq]: [batch, seq, seq], where j > i is also seen when i and j are
    tokens of the same image, the window applying after (transformers' Gemma 3 masks: the
    window AND (causal OR same image))."""
    rows = torch.arange(seq, device=device).unsqueeze(1)
    cols = torch.arange(seq, device=device).unsqueeze(0)
    allowed = cols <= rows
    if groups is not None:
        allowed = allowed | same_image(groups, groups)
    return allowed if window is None else allowed & (rows - cols < window)


def same_image(query_groups: torch.Tensor, key_groups: torch.Tensor) -> torch.Tensor:
    """[batch, queries, keys] True where a query and a key are tokens of the same image."""
    query, key = query_groups.unsqueeze(2), key_groups.unsqueeze(1)
    return (query == key) & (query >= 0)


def _capped_attention(q, k, v, scale: float, allowed: torch.Tensor, softcap: float) -> torch.Tensor:
    """Explicit scores, since SDPA cannot cap them; kv heads are shared by groups of query heads."""
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    grouped = q.view(batch, seq, kv_heads, heads // kv_heads, dim).permute(
        0, 2, 3, 1, 4
    )  # [b, kvh, g, s, d]
    scores = (grouped @ k.permute(0, 2, 3, 1).unsqueeze(2)) * scale  # [b, kvh, g, s, s]
    scores = torch.tanh(scores / softcap) * softcap
    if allowed.dim() == 3:  # per row (images): [batch, 1, 1, seq, seq]
        allowed = allowed.view(batch, 1, 1, seq, seq)
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = probs @ v.permute(0, 2, 1, 3).unsqueeze(2)  # [b, kvh, g, s, d]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, seq, heads, dim)
