"""Flat paged attention and padded prompt attention against naive attention."""

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.attention import DecodeMetadata, PrefillMetadata, attention, prepare_metadata
from engine.attention.backend import AttentionBackend, use_backend
from engine.attention.flat import flat_attention, flat_block_tensors, flat_mask
from engine.attention.prompt import prompt_attention
from engine.attention.rows import PADDED_MAX_RATIO, row_attention, row_block_tensors
from engine.kv_cache import blocks_needed, slots_for


def naive_attention(q, keys, values, scale):
    """q: [heads, dim]; keys/values: [tokens, kv_heads, dim] -> [heads, dim]."""
    group = q.shape[0] // keys.shape[1]
    keys = keys.repeat_interleave(group, dim=1)
    values = values.repeat_interleave(group, dim=1)
    weights = torch.softmax(torch.einsum("hd,thd->ht", q * scale, keys), dim=-1)
    return torch.einsum("ht,thd->hd", weights, values)


@st.composite
def flat_cases(draw):
    block_size = draw(st.sampled_from([1, 2, 4, 16]))
    kv_heads, group, dim = (
        draw(st.sampled_from([1, 2])),
        draw(st.sampled_from([1, 3])),
        draw(st.sampled_from([4, 8])),
    )
    lengths = draw(st.lists(st.integers(1, 40), min_size=1, max_size=5))
    padding_rows, padding_blocks = draw(st.integers(0, 2)), draw(st.integers(0, 3))
    seed = draw(st.integers(0, 2**16))
    return block_size, kv_heads, group, dim, lengths, padding_rows, padding_blocks, seed


def scattered_rows(case):
    """Rows of the given lengths whose blocks are scattered over a random cache in random order
    (block 0 stays reserved), their queries (with padding rows) in float64."""
    block_size, kv_heads, group, dim, lengths, padding_rows, _, seed = case
    gen = torch.Generator().manual_seed(seed)
    needed = [blocks_needed(n, block_size) for n in lengths]
    total_blocks = sum(needed) + 1 + 3
    order = (torch.randperm(total_blocks - 1, generator=gen) + 1).tolist()
    row_blocks = [order[sum(needed[:i]) : sum(needed[: i + 1])] for i in range(len(lengths))]
    caches = [
        torch.randn(total_blocks * block_size, kv_heads, dim, generator=gen, dtype=torch.float64)
        for _ in "kv"
    ]
    q = torch.randn(
        len(lengths) + padding_rows, kv_heads * group, dim, generator=gen, dtype=torch.float64
    )
    return row_blocks, *caches, q


def assert_rows_equal_naive(out, q, key_cache, value_cache, row_blocks, lengths, block_size, scale):
    assert torch.isfinite(out).all()  # padded rows and blocks must not produce NaN
    for row, (blocks, length) in enumerate(zip(row_blocks, lengths)):
        slots = slots_for(blocks, 0, length, block_size)
        expected = naive_attention(q[row], key_cache[slots], value_cache[slots], scale)
        torch.testing.assert_close(out[row], expected, rtol=1e-9, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(flat_cases())
def test_flat_attention_equals_naive(case):
    block_size, _, _, dim, lengths, _, padding_blocks, _ = case
    row_blocks, key_cache, value_cache, q = scattered_rows(case)
    scale = 1 / math.sqrt(dim)
    num_blocks = sum(len(blocks) for blocks in row_blocks) + padding_blocks
    block_list, groups, usage = flat_block_tensors(row_blocks, lengths, num_blocks, block_size)
    mapping, owners, bias = flat_mask(groups, usage, q.shape[0], block_size, torch.float64)
    out = flat_attention(q, key_cache, value_cache, block_list, mapping, owners, bias, scale)
    assert_rows_equal_naive(out, q, key_cache, value_cache, row_blocks, lengths, block_size, scale)


@settings(max_examples=30, deadline=None)
@given(st.lists(st.integers(1, 12), min_size=1, max_size=4), st.integers(0, 2**16))
def test_prompt_attention_with_right_padding_equals_per_sequence_causal(lengths, seed):
    gen = torch.Generator().manual_seed(seed)
    width, heads, kv_heads, dim = max(lengths) + 3, 4, 2, 8
    q = torch.randn(len(lengths), width, heads, dim, generator=gen)
    k = torch.randn(len(lengths), width, kv_heads, dim, generator=gen)
    v = torch.randn(len(lengths), width, kv_heads, dim, generator=gen)
    out = prompt_attention(q, k, v, 0.3)
    for row, length in enumerate(lengths):
        for pos in range(length):
            expected = naive_attention(q[row, pos], k[row, : pos + 1], v[row, : pos + 1], 0.3)
            torch.testing.assert_close(out[row, pos], expected, rtol=1e-5, atol=1e-5)


def test_attention_writes_keys_and_values_at_their_slots():
    cache = (torch.zeros(8, 1, 2), torch.zeros(8, 1, 2))
    k = torch.arange(8.0).view(1, 4, 1, 2)
    v = -k
    slots = torch.tensor([5, 6, 7, 0])  # the last token is padding: it goes to the reserved block
    attention(torch.zeros(1, 4, 1, 2), k, v, cache, PrefillMetadata(slots), 1.0)
    torch.testing.assert_close(cache[0][5:8].flatten(), torch.arange(6.0))
    torch.testing.assert_close(cache[1][5:8].flatten(), -torch.arange(6.0))
    assert cache[0][1:5].abs().sum() == 0


@settings(max_examples=40, deadline=None)
@given(flat_cases())
def test_row_attention_equals_naive(case):
    """Each row's blocks padded to the longest row, one fused call (eager CPU; any batch-1 bucket)."""
    block_size, lengths = case[0], case[4]
    row_blocks, key_cache, value_cache, q = scattered_rows(case)
    batch, needed = q.shape[0], [len(blocks) for blocks in row_blocks]
    rows = row_block_tensors(row_blocks, lengths, batch, block_size, torch.float64)
    if (
        rows is None
    ):  # padding would cost more than flat attention: the runner keeps the flat layout
        assert batch * max(needed) > PADDED_MAX_RATIO * sum(needed)
        return
    table, bias = rows
    out = row_attention(q, key_cache, value_cache, table, bias.view(batch, 1, 1, -1), 0.35)
    assert_rows_equal_naive(out, q, key_cache, value_cache, row_blocks, lengths, block_size, 0.35)


def test_rows_far_apart_in_length_keep_the_flat_layout():
    assert (
        row_block_tensors([[1] * 40, [2], [3], [4]], [640, 16, 16, 16], 4, 16, torch.float32)
        is None
    )
    table, bias = row_block_tensors([[1, 2], [3]], [20, 5], 3, 16, torch.float32)
    assert table.tolist() == [[1, 2], [3, 0], [0, 0]]
    assert (bias[0] == 0).sum() == 20 and (bias[1] == 0).sum() == 5 and (bias[2] < 0).all()


def _decode_meta(batch: int) -> DecodeMetadata:
    block_list, groups, usage = flat_block_tensors([[1]] * batch, [3] * batch, batch, 4)
    mapping, owners, bias = flat_mask(groups, usage, batch, 4, torch.float32)
    return DecodeMetadata(torch.tensor([2] * batch), block_list, mapping, owners, bias)


def test_a_batch_one_bucket_on_the_torch_kernels_reads_its_flat_list_as_its_row():
    lone = prepare_metadata(_decode_meta(1), 1)
    assert torch.equal(lone.row_attention[0], lone.block_list.view(1, -1))
    assert (
        prepare_metadata(_decode_meta(2), 1).row_attention is None
    )  # the runner did not pad these rows
    device_kernels = AttentionBackend("device", prompt_attention, flat_attention)
    with use_backend(device_kernels):  # a device's own decode kernel is never bypassed
        assert prepare_metadata(_decode_meta(1), 1).row_attention is None
