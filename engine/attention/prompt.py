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
) -> torch.Tensor:
    """Causal attention over a right-padded [batch, seq] prompt batch.

    Prompts are padded on the right, so the causal mask alone keeps every real token from seeing
    padding: padding only ever sits at later positions. Padded rows compute garbage that the
    runner discards. q: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim].
    `window`: a sliding-window layer sees only keys less than `window` positions back (prompts start
    at position 0, so positions are the column indices). `softcap`: Gemma 2's capped scores.
    `lengths` (each row's real length) is not needed here: the causal mask already keeps every real
    token from the padding; kernels that can skip the padding's work take it (FusedSDPA).
    """
    if softcap is not None:
        return _capped_attention(q, k, v, scale, _allowed(q.shape[1], window, q.device), softcap)
    mask = None if window is None else _allowed(q.shape[1], window, q.device)
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


def _allowed(seq: int, window: int | None, device) -> torch.Tensor:
    """[seq, seq] True where query i may see key j: j <= i, and i - j < window for a window."""
    rows = torch.arange(seq, device=device).unsqueeze(1)
    cols = torch.arange(seq, device=device).unsqueeze(0)
    allowed = cols <= rows
    return allowed if window is None else allowed & (rows - cols < window)


def _capped_attention(q, k, v, scale: float, allowed: torch.Tensor, softcap: float) -> torch.Tensor:
    """Explicit scores, since SDPA cannot cap them; kv heads are shared by groups of query heads."""
    batch, seq, heads, dim = q.shape
    kv_heads = k.shape[2]
    grouped = q.view(batch, seq, kv_heads, heads // kv_heads, dim).permute(
        0, 2, 3, 1, 4
    )  # [b, kvh, g, s, d]
    scores = (grouped @ k.permute(0, 2, 3, 1).unsqueeze(2)) * scale  # [b, kvh, g, s, s]
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~allowed, torch.finfo(scores.dtype).min)
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    out = probs @ v.permute(0, 2, 1, 3).unsqueeze(2)  # [b, kvh, g, s, d]
    return out.permute(0, 3, 1, 2, 4).reshape(batch, seq, heads, dim)
