"""Flat paged attention for decode (one new token per row).

The blocks of every row are concatenated into one flat block list. Each block is attended on its
own (a block-local softmax), then the blocks of a row are merged with the usual log-sum-exp
rescaling. Cost follows the number of blocks actually used, not the longest row times the batch.
All inputs are tensors, so one graph serves every batch of the same bucket.
"""

import torch
import torch.nn.functional as F

PADDING_BLOCK = 0


# exp() of a large negative argument takes a slow path on CPUs, and a subnormal result a far slower
# one; the kernel never needs values below exp(-80) (1.8e-35), so arguments are clamped there and
# masked entries are then set to exactly zero.
EXP_FLOOR = -80.0


def flat_attention(
    q: torch.Tensor,  # [batch, heads, dim]
    key_cache: torch.Tensor,  # [num_slots, kv_heads, dim]
    value_cache: torch.Tensor,  # [num_slots, kv_heads, dim]
    block_list: torch.Tensor,  # [num_blocks]
    # [num_blocks, batch] one-hot (device kernels use it; this one needs only groups)
    block_mapping: torch.Tensor,
    block_groups: torch.Tensor,  # [num_blocks] owner row (0 for padding blocks)
    block_bias: torch.Tensor,  # [num_blocks, block_size] 0 where valid, negative past usage
    scale: float,
    masked: torch.Tensor | None = None,  # flat_masked(block_bias, kv_heads), when already computed
    softcap: float | None = None,  # Gemma 2: scores become softcap * tanh(scores / softcap)
) -> torch.Tensor:
    batch, heads, dim = q.shape
    num_blocks, block_size = block_bias.shape
    kv_heads = key_cache.shape[1]
    group = heads // kv_heads

    # Each block gets its owner's query by index, not by a one-hot matmul (that costs blocks x
    # batch).
    qb = (q * scale).index_select(0, block_groups).view(num_blocks, kv_heads, group, dim)
    # One gather of the blocks in use, kept in the cache's layout [blocks, block_size, kv_heads,
    # dim].
    keys = key_cache.view(-1, block_size, kv_heads, dim).index_select(0, block_list)
    values = value_cache.view(-1, block_size, kv_heads, dim).index_select(0, block_list)
    # Per kv head, its query heads meet only its keys (GQA: no cross-group products); the slices are
    # strided views that bmm takes as they are, where a [blocks, kv_heads, ...] transpose would be
    # copied.
    scores = torch.stack(
        [torch.bmm(qb[:, h], keys[:, :, h].transpose(1, 2)) for h in range(kv_heads)], 1
    )
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if masked is None:
        masked = flat_masked(block_bias, kv_heads)
    scores = scores.masked_fill_(masked, torch.finfo(scores.dtype).min / 2)

    block_max = scores.amax(dim=-1, keepdim=True)  # [blocks, kv_heads, group, 1]
    probs = scores.sub_(block_max).clamp_min_(EXP_FLOOR).exp_().masked_fill_(masked, 0.0)
    block_max = block_max.view(num_blocks, heads)
    block_sum = probs.sum(dim=-1).view(num_blocks, heads)
    block_out = torch.stack([torch.bmm(probs[:, h], values[:, :, h]) for h in range(kv_heads)], 1)

    row_max = _row_max(block_max, block_groups, batch)  # [batch, heads]
    rescale = (block_max - row_max.index_select(0, block_groups)).clamp_min_(EXP_FLOOR).exp_()
    # Each row sums its own blocks. Padding blocks belong to row 0 and add exact zeros (all masked).
    weighted = block_out.view(num_blocks, heads, dim) * rescale.unsqueeze(-1)
    numerator = weighted.new_zeros(batch, heads, dim).index_add_(0, block_groups, weighted)
    denominator = rescale.new_zeros(batch, heads).index_add_(0, block_groups, block_sum * rescale)
    # Real rows always have denominator >= 1 (their maximal score contributes exp(0)); the clamp
    # only keeps padded rows, which own no block, at 0 instead of 0/0.
    return numerator / denominator.clamp_min(1e-30).view(batch, heads, 1)


def flat_masked(block_bias: torch.Tensor, kv_heads: int) -> torch.Tensor:
    """[blocks, 1, 1, block_size]: True for positions past a block's usage (the same for every layer
    and every head; the scores it masks are [blocks, kv_heads, group, block_size])."""
    num_blocks, block_size = block_bias.shape
    return (block_bias < 0).view(num_blocks, 1, 1, block_size)


def _row_max(block_max: torch.Tensor, block_groups: torch.Tensor, batch: int) -> torch.Tensor:
    """Largest block maximum of each row.

    Padding blocks are attributed to row 0, which is harmless: every position of a padding block
    carries the large negative bias, so its maximum never exceeds a real row's.
    """
    index = block_groups.view(-1, 1).expand_as(block_max)
    floor = torch.full(
        (batch, *block_max.shape[1:]),
        torch.finfo(block_max.dtype).min,
        dtype=block_max.dtype,
        device=block_max.device,
    )
    return floor.scatter_reduce(0, index, block_max, reduce="amax")


def flat_block_tensors(
    row_blocks: list[list[int]], row_lengths: list[int], num_blocks: int, block_size: int
):
    """block_list, block_groups (-1 for padding) and block_usage for rows whose KV lives in
    `row_blocks` and holds `row_lengths` tokens, padded with the reserved block to num_blocks."""
    block_list, groups, usage = [], [], []
    for row, (blocks, length) in enumerate(zip(row_blocks, row_lengths)):
        block_list += blocks
        groups += [row] * len(blocks)
        usage += [block_size] * (len(blocks) - 1) + [length - (len(blocks) - 1) * block_size]
    padding = num_blocks - len(block_list)
    return (
        torch.tensor(block_list + [PADDING_BLOCK] * padding),
        torch.tensor(groups + [-1] * padding),
        torch.tensor(usage + [0] * padding),
    )


def flat_mask(
    block_groups: torch.Tensor,
    block_usage: torch.Tensor,
    batch: int,
    block_size: int,
    dtype: torch.dtype,
):
    """block_mapping (one-hot owner, zero rows for padding), owner rows clamped for indexing, and
    the bias that masks every position past a block's usage."""
    owned = (block_groups >= 0).unsqueeze(1)
    mapping = F.one_hot(block_groups.clamp(min=0), batch) * owned
    # A large but finite bias: a padding block is fully masked, and -inf there would give NaN.
    masked = torch.finfo(dtype).min / 2
    past_usage = torch.arange(block_size) >= block_usage.unsqueeze(1)
    bias = torch.zeros(past_usage.shape, dtype=dtype).masked_fill(past_usage, masked)
    return mapping.to(dtype), block_groups.clamp(min=0), bias
