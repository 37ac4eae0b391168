"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM), tensor-parallel.

The architectures differ only in flags of ModelConfig (q/k/v biases, rope schedule, tied
embeddings), so one module serves them all. q/k/v and gate/up are fused into one matmul each:
fewer, larger GEMMs are faster on every device. With several shards, attention heads and the MLP
are split Megatron-style (column-parallel in, row-parallel out) and the vocabulary is split too.
"""
import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, attention, prepare_metadata
from engine.devices.hooks import mark_step
from engine.distributed import SINGLE, Parallel
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import RowParallelLinear, merged_parallel, qkv_parallel
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.models.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig, parallel: Parallel):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = qkv_parallel(config.hidden_size, config.head_dim, config.num_heads, config.num_kv_heads,
                                     config.qkv_bias, parallel)
        self.q_size = self.qkv_proj.parts["q"][2]
        self.kv_size = self.qkv_proj.parts["k"][2]
        self.num_heads, self.num_kv_heads = self.q_size // self.head_dim, self.kv_size // self.head_dim
        self.scale = self.head_dim**-0.5
        self.o_proj = RowParallelLinear(config.num_heads * config.head_dim, config.hidden_size, config.o_bias, parallel)
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # bound by the KV cache

    def forward(self, rope, hidden, meta: AttentionMetadata, lora=None):
        q, k, v = self.qkv_proj(hidden, lora).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        lead = hidden.shape[:-1]
        q = q.view(*lead, self.num_heads, self.head_dim)
        k = k.view(*lead, self.num_kv_heads, self.head_dim)
        v = v.view(*lead, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, *rope)
        out = attention(q, k, v, self.kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(*lead, self.q_size), lora)


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig, parallel: Parallel):
        super().__init__()
        self.gate_up_proj = merged_parallel(config.hidden_size, config.intermediate_size, ["gate", "up"],
                                            config.mlp_bias, parallel)
        self.down_proj = RowParallelLinear(config.intermediate_size, config.hidden_size, config.mlp_bias, parallel)

    def forward(self, x, lora=None):
        gate, up = self.gate_up_proj(x, lora).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up, lora)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, parallel: Parallel):
        super().__init__()
        self.self_attn = LlamaAttention(config, parallel)
        self.mlp = LlamaMLP(config, parallel)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, hidden, meta, lora=None):
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), meta, lora)
        return hidden + self.mlp(self.post_attention_layernorm(hidden), lora)


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fused module, part)
    stacked_params = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def __init__(self, config: ModelConfig, max_positions: int, parallel: Parallel = SINGLE):
        super().__init__()
        self.config, self.parallel = config, parallel
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, parallel) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, max_positions)
        self.local_kv_heads = self.layers[0].self_attn.num_kv_heads
        self.lora_set = None  # LoraSet of the served adapters, set by engine.lora_loader

    def forward(self, input_ids, positions, meta: AttentionMetadata, logits_indices, lora_index=None) -> torch.Tensor:
        """Logits (float32, full vocabulary) of the tokens at `logits_indices` of the flattened batch.
        `lora_index`: each token's adapter slot (-1: none), shaped like input_ids; None without adapters."""
        hidden = self.embed_tokens(input_ids)
        # Per-step work that every layer shares is done once here.
        rope = self.rotary.cos_sin(positions, hidden.dtype)
        meta = prepare_metadata(meta, self.local_kv_heads)
        lora = None if lora_index is None else self.lora_set.selector(lora_index, hidden.dtype)
        for layer in self.layers:
            hidden = layer(rope, hidden, meta, lora)
            mark_step()  # HPU lazy mode: a graph per layer compiles far faster than one per model
        hidden = self.norm(hidden).reshape(-1, self.config.hidden_size).index_select(0, logits_indices)
        return self.lm_head.logits(hidden).float()

    def bind_kv_cache(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, cache in zip(self.layers, caches, strict=True):
            layer.self_attn.kv_cache = cache

    def checkpoint_target(self, name: str) -> tuple[str, str, str | None]:
        """(our module path, 'weight' or 'bias', fused part or None) for a checkpoint tensor name."""
        for fragment, (fused, part) in self.stacked_params.items():
            if f".{fragment}." in name:
                module, _, kind = name.replace(fragment, fused).rpartition(".")
                return module, kind, part
        module, _, kind = name.rpartition(".")
        return module, kind, None
