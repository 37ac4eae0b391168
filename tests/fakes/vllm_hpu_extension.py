"""A fake vllm-hpu-extension: `ops.flat_pa` and `ops.prompt_attention` computed naively, straight
from the arguments the real kernels take, so a caller that passes a wrong layout gets wrong numbers.
The contract flat_pa relies on is checked: padding blocks (all-zero mapping rows) must sit in a
group of their own (index `batch`), or the real kernel divides 0 by 0 in its block merge."""
from __future__ import annotations

import torch
import torch.nn.functional as F

from tests.fakes.modules import fake_module, install


class FakeExtension:
    def __init__(self):
        self.calls = {"flat_pa": 0, "prompt_attention": 0, "fused_sdpa": 0}

    def flat_pa(self, *, query, key_cache, value_cache, block_list, block_mapping, block_bias, block_groups, scale,
                keys_fetch_func, values_fetch_func, **matmul_ops):
        self.calls["flat_pa"] += 1
        batch, one, hidden = query.shape
        _, block_size, kv_heads, dim = key_cache.shape
        assert one == 1 and block_mapping.shape == (len(block_list), batch)
        padding = block_mapping.sum(1) == 0
        assert bool((block_groups[padding] == batch).all()), "padding blocks share a real row's group"
        keys, values = keys_fetch_func(key_cache, block_list), values_fetch_func(value_cache, block_list)
        heads = hidden // dim
        out = torch.zeros(batch, heads, dim, dtype=query.dtype)
        for row in range(batch):
            mine = block_groups == row
            if mine.any():
                out[row] = _attend(query[row].view(heads, dim), keys[mine].reshape(-1, kv_heads, dim),
                                   values[mine].reshape(-1, kv_heads, dim), block_bias[mine].reshape(-1), scale)
        return out

    def prompt_attention(self, impl, *, query, key, value, scale, fsdpa_op, is_causal, attn_bias, valid_seq_lengths):
        self.calls["prompt_attention"] += 1
        assert impl == "fsdpa_impl" and (attn_bias is not None or valid_seq_lengths is not None)
        q, k, v = (t.transpose(1, 2) for t in (query, key, value))
        return fsdpa_op(q, k, v, attn_bias, 0.0, is_causal, scale, "fast", True, valid_seq_lengths, "right").transpose(1, 2)

    def fused_sdpa(self, q, k, v, mask, dropout, is_causal, scale, softmax_mode, recompute, lengths, padding_side):
        self.calls["fused_sdpa"] += 1
        assert padding_side == "right" and bool((lengths == q.shape[2]).all())
        return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=scale, enable_gqa=True)

    def install(self, monkeypatch) -> None:
        fused = type("FusedSDPA", (), {"apply": staticmethod(self.fused_sdpa)})

        class ModuleFusedSDPA:
            def __init__(self, kernel):
                self.kernel = kernel

            def __call__(self, *args):
                return self.kernel.apply(*args)

        install(monkeypatch, {
            "vllm_hpu_extension": fake_module("vllm_hpu_extension"),
            "vllm_hpu_extension.ops": fake_module("vllm_hpu_extension.ops", flat_pa=self.flat_pa,
                                                  prompt_attention=self.prompt_attention),
            "vllm_hpu_extension.utils": fake_module("vllm_hpu_extension.utils", ModuleFusedSDPA=ModuleFusedSDPA),
            "habana_frameworks.torch.hpex": fake_module("habana_frameworks.torch.hpex"),
            "habana_frameworks.torch.hpex.kernels": fake_module("habana_frameworks.torch.hpex.kernels", FusedSDPA=fused),
        })


def _attend(q, keys, values, bias, scale):
    """q: [heads, dim]; keys, values: [tokens, kv_heads, dim]; bias: [tokens] (negative: masked)."""
    group = q.shape[0] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    valid = bias >= 0
    weights = torch.softmax(torch.einsum("hd,thd->ht", q * scale, keys[valid]), dim=-1)
    return torch.einsum("ht,thd->hd", weights, values[valid])
