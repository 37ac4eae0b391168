"""vllm-hpu-extension's kernels behind our attention contracts: flat_pa for decode, the fused SDPA
kernel for prefill. Without the extension, attention stays pure torch (logged once)."""
from __future__ import annotations

import logging
from functools import partial

import torch

from engine.attention.backend import AttentionBackend

log = logging.getLogger(__name__)
_told = False


def load_backend() -> AttentionBackend | None:
    try:
        from vllm_hpu_extension import ops
        from vllm_hpu_extension.utils import ModuleFusedSDPA
        from habana_frameworks.torch.hpex.kernels import FusedSDPA
    except ImportError as err:
        _tell_once(f"vllm-hpu-extension is not importable ({err}): attention runs in pure torch")
        return None
    _tell_once("attention: vllm-hpu-extension flat_pa (decode) and FusedSDPA (prefill)")
    return AttentionBackend("vllm-hpu-extension", partial(fused_prefill, ops, ModuleFusedSDPA(FusedSDPA)),
                            partial(flat_pa_decode, ops))


def _tell_once(message: str) -> None:
    global _told
    if not _told:
        log.info(message)
        _told = True


def fused_prefill(ops, fsdpa, q, k, v, scale: float) -> torch.Tensor:
    """q: [batch, seq, heads, dim]; k, v: [batch, seq, kv_heads, dim], right-padded prompts.
    Every row is given the full width as its valid length: causality alone keeps real tokens
    from seeing padding (it sits after them), as in prompt_attention."""
    lengths = torch.full((q.shape[0],), q.shape[1], dtype=torch.int32, device=q.device)
    return ops.prompt_attention(impl="fsdpa_impl", query=q, key=k, value=v, scale=scale, fsdpa_op=fsdpa,
                                is_causal=True, attn_bias=None, valid_seq_lengths=lengths)


def flat_pa_decode(ops, q, key_cache, value_cache, block_list, block_mapping, block_groups, block_bias, scale,
                   masked=None) -> torch.Tensor:
    """flat_attention's contract on flat_pa. Two layouts differ: flat_pa wants the cache as
    [blocks, block_size, kv_heads, dim], and padding blocks in a group of their own (row `batch`):
    grouped with a real row, their zero weight would meet a 0/0 in the block merge."""
    batch, heads, dim = q.shape
    block_size, kv_heads = block_bias.shape[1], key_cache.shape[1]
    padding = block_mapping.sum(dim=1) == 0
    return ops.flat_pa(
        query=q.reshape(batch, 1, heads * dim),
        key_cache=key_cache.view(-1, block_size, kv_heads, dim),
        value_cache=value_cache.view(-1, block_size, kv_heads, dim),
        block_list=block_list, block_mapping=block_mapping, block_bias=block_bias,
        block_groups=block_groups.masked_fill(padding, batch), scale=scale,
        matmul_qk_op=torch.matmul, matmul_av_op=torch.matmul,
        batch2block_matmul_op=torch.matmul, block2batch_matmul_op=torch.matmul,
        keys_fetch_func=_fetch_blocks, values_fetch_func=_fetch_blocks,
    ).view(batch, heads, dim)


def _fetch_blocks(cache: torch.Tensor, blocks: torch.Tensor) -> torch.Tensor:
    return cache.index_select(0, blocks)
