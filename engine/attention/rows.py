"""Decode attention over each row's own blocks, padded to the longest row: one fused call.

Flat attention (flat.py) pays a fixed amount of bookkeeping per block (block-local softmax, rescale,
per-row sums) and runs its products as thousands of tiny matrices: the right layout for a device
graph, whose shapes must not depend on the rows, but slow on a CPU. Here each row's blocks are
gathered into a [batch, kv_heads, width * block_size, dim] view and scaled_dot_product_attention
runs once, masked past each row's length. The width is the longest row's block count, so the
runner builds these tensors only where nothing is compiled (eager CPU) and only while padding costs
at most PADDED_MAX_RATIO times the real blocks; a lone row's flat block list is already its table,
so a batch-1 bucket takes this path on every device with the pure-torch kernels.

One layer of SmolLM2 (9 heads over 3 KV heads, 16-token blocks, 2 threads), flat against padded:
batch 1 over 16 blocks 219 / 89 us (float32) and 449 / 71 us (bfloat16); batch 32 at about 150
tokens 2765 / 1112 us (bfloat16); batch 128 9495 / 3703 us (bfloat16).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.attention.flat import PADDING_BLOCK

PADDED_MAX_RATIO = 3  # padded blocks / real blocks up to which the padded call beats flat attention


def row_block_tensors(
    row_blocks: list[list[int]],
    row_lengths: list[int],
    batch: int,
    block_size: int,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """row_table [batch, width] (each row's blocks in order, then the reserved block) and row_bias
    [batch, width * block_size] (0 up to the row's length, a large negative after; padding rows are
    all masked and get a finite average, never read). None where padding would cost too much."""
    width = max(len(blocks) for blocks in row_blocks)
    if batch * width > PADDED_MAX_RATIO * sum(len(blocks) for blocks in row_blocks):
        return None
    table = [blocks + [PADDING_BLOCK] * (width - len(blocks)) for blocks in row_blocks]
    table += [[PADDING_BLOCK] * width] * (batch - len(row_blocks))
    lengths = torch.tensor(row_lengths + [0] * (batch - len(row_blocks)))
    past = torch.arange(width * block_size) >= lengths.unsqueeze(1)
    bias = torch.zeros(past.shape, dtype=dtype).masked_fill(past, torch.finfo(dtype).min / 2)
    return torch.tensor(table), bias


def row_attention(
    q: torch.Tensor,  # [batch, heads, dim]
    key_cache: torch.Tensor,  # [num_slots, kv_heads, dim]
    value_cache: torch.Tensor,  # [num_slots, kv_heads, dim]
    row_table: torch.Tensor,  # [batch, width]
    row_mask: torch.Tensor,  # [batch, 1, 1, width * block_size] additive
    scale: float,
) -> torch.Tensor:
    batch, heads, dim = q.shape
    kv_heads = key_cache.shape[1]
    positions = row_mask.shape[-1]
    block_size = positions // row_table.shape[1]
    keys = key_cache.view(-1, block_size, kv_heads, dim).index_select(0, row_table.view(-1))
    values = value_cache.view(-1, block_size, kv_heads, dim).index_select(0, row_table.view(-1))
    keys = keys.view(batch, positions, kv_heads, dim).transpose(
        1, 2
    )  # [batch, kv_heads, positions, dim]
    values = values.view(batch, positions, kv_heads, dim).transpose(1, 2)
    out = F.scaled_dot_product_attention(
        q.unsqueeze(2), keys, values, attn_mask=row_mask, scale=scale, enable_gqa=heads != kv_heads
    )
    return out.view(batch, heads, dim)
