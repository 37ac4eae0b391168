"""The pure-torch flat attention (the fallback on every device without its own kernel): right, and
grouped by kv head (finding 10): a query head is multiplied only by the kv head of its group,
and only by the blocks of its own row."""

import torch
from torch.utils.flop_counter import FlopCounterMode

from engine.attention.flat import flat_attention, flat_block_tensors, flat_mask

BATCH, HEADS, KV_HEADS, DIM, BLOCK, SLOTS = 2, 8, 4, 16, 16, 8 * 16


def inputs():
    torch.manual_seed(0)
    rows, lengths = [[1, 2, 3], [5, 6]], [40, 20]
    block_list, groups, usage = flat_block_tensors(rows, lengths, 6, BLOCK)
    mapping, owners, bias = flat_mask(groups, usage, BATCH, BLOCK, torch.float32)
    q = torch.randn(BATCH, HEADS, DIM)
    keys, values = torch.randn(SLOTS, KV_HEADS, DIM), torch.randn(SLOTS, KV_HEADS, DIM)
    return (q, keys, values, block_list, mapping, owners, bias, DIM**-0.5), rows, lengths


def reference(q, keys, values, rows, lengths, scale):
    out = []
    for row, (blocks, length) in enumerate(zip(rows, lengths)):
        slots = torch.cat([torch.arange(b * BLOCK, (b + 1) * BLOCK) for b in blocks])[:length]
        k = keys[slots].repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
        v = values[slots].repeat_interleave(HEADS // KV_HEADS, 1).transpose(0, 1)
        weights = torch.softmax(q[row].unsqueeze(1) @ k.transpose(1, 2) * scale, dim=-1)
        out.append((weights @ v).squeeze(1))
    return torch.stack(out)


def test_flat_attention_matches_per_row_attention():
    args, rows, lengths = inputs()
    torch.testing.assert_close(
        flat_attention(*args), reference(args[0], args[1], args[2], rows, lengths, args[-1])
    )


def test_flat_attention_does_no_cross_group_or_cross_row_products():
    """The only products are each query head with its own kv head's keys and values in its own row's
    blocks: no cross-group products, and no one-hot [blocks, batch] matmuls taking queries to blocks
    and outputs back to rows (those cost blocks x batch; an index select and an index add do it)."""
    args, _, _ = inputs()
    with FlopCounterMode(display=False) as counter:
        flat_attention(*args)
    blocks = len(args[3])
    per_head_products = 2 * (2 * blocks * HEADS * BLOCK * DIM)  # scores and weighted values
    assert counter.get_total_flops() == per_head_products
