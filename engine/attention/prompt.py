import torch
import torch.nn.functional as F


def prompt_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention over a right-padded [batch, seq] prompt batch.

    Prompts are padded on the right, so the causal mask alone keeps every real token from seeing
    padding: padding only ever sits at later positions. Padded rows compute garbage that the
    runner discards. q: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim].
    """
    out = F.scaled_dot_product_attention(
        q.transpose(1, 2),
        k.transpose(1, 2),
        v.transpose(1, 2),
        is_causal=True,
        scale=scale,
        enable_gqa=q.shape[2] != k.shape[2],
    )
    return out.transpose(1, 2)
