"""A tiny random Llama built directly (no checkpoint, no tokenizer) and a runner around it, for
driving a device adapter through the real bucket runner on CPU."""

from __future__ import annotations

import torch

from engine.buckets.grid import BucketPlan, DecodeBucket, PrefillBucket
from engine.config import ServingLimits
from engine.distributed import SINGLE, Parallel
from engine.kv_cache import KVCache
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM
from engine.runner import DecodeInput, ModelRunner, PrefillInput

BLOCK = 4
CONFIG = ModelConfig(
    architecture="LlamaForCausalLM",
    vocab_size=96,
    hidden_size=32,
    intermediate_size=64,
    num_layers=3,
    num_heads=4,
    num_kv_heads=2,
    head_dim=8,
    rms_norm_eps=1e-5,
    max_position_embeddings=64,
    tie_word_embeddings=False,
    qkv_bias=False,
    o_bias=False,
    mlp_bias=False,
)
PLAN = BucketPlan(
    prefill=(PrefillBucket(1, 8), PrefillBucket(2, 8)),
    decode=(DecodeBucket(2, 4), DecodeBucket(2, 8), DecodeBucket(4, 8)),
)

LIMITS = ServingLimits(
    max_batch_size=2, max_prefill_tokens=16, max_input_tokens=8, max_total_tokens=16
)


def tiny_model(parallel: Parallel = SINGLE, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    model = LlamaForCausalLM(CONFIG, CONFIG.max_position_embeddings, parallel).eval()
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.3)
    return model


def runner_for(model, adapter, plan: BucketPlan = PLAN) -> ModelRunner:
    cache = KVCache(
        CONFIG.num_layers,
        16,
        BLOCK,
        model.local_kv_heads,
        CONFIG.head_dim,
        torch.float32,
        adapter.torch_device,
    )
    return ModelRunner(model, adapter, cache, plan, torch.float32)


def prompts(lengths=(5, 7)) -> list[PrefillInput]:
    """Prompts of the given lengths, each in its own blocks (1-2, 3-4, ...; block 0 is reserved)."""
    out = []
    for row, length in enumerate(lengths):
        first = 1 + 2 * row
        out.append(
            PrefillInput(
                [(7 * row + i) % CONFIG.vocab_size for i in range(length)],
                [first * BLOCK + i for i in range(length)],
            )
        )
    return out


def next_steps(lengths=(5, 7), tokens=(11, 12)) -> list[DecodeInput]:
    """The decode step after `prompts(lengths)`: each row's next token at its next position."""
    rows = []
    for row, (length, token) in enumerate(zip(lengths, tokens)):
        first = 1 + 2 * row
        rows.append(DecodeInput(token, length, first * BLOCK + length, [first, first + 1]))
    return rows
