"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, SmolLM).

The architectures differ only in flags of ModelConfig (q/k/v biases, rope schedule, tied
embeddings), so one module serves them all. q/k/v and gate/up are fused into one matmul each:
fewer, larger GEMMs are faster on every device, and the loader fills the fused weights by slice.
"""
import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import AttentionMetadata, attention, prepare_metadata
from engine.layers.norm import RMSNorm
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.models.config import ModelConfig


class LlamaAttention(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = config.num_heads, config.num_kv_heads, config.head_dim
        self.q_size = self.num_heads * self.head_dim
        self.kv_size = self.num_kv_heads * self.head_dim
        self.scale = self.head_dim**-0.5
        self.qkv_proj = nn.Linear(config.hidden_size, self.q_size + 2 * self.kv_size, bias=config.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, config.hidden_size, bias=config.o_bias)
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # bound by the KV cache

    def forward(self, rope, hidden, meta: AttentionMetadata):
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        lead = hidden.shape[:-1]
        q = q.view(*lead, self.num_heads, self.head_dim)
        k = k.view(*lead, self.num_kv_heads, self.head_dim)
        v = v.view(*lead, self.num_kv_heads, self.head_dim)
        q, k = apply_rotary(q, k, *rope)
        out = attention(q, k, v, self.kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(*lead, self.q_size))


class LlamaMLP(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=config.mlp_bias)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=config.mlp_bias)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.self_attn = LlamaAttention(config)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, rope, hidden, meta):
        hidden = hidden + self.self_attn(rope, self.input_layernorm(hidden), meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaForCausalLM(nn.Module):
    # checkpoint name fragment -> (our fused parameter fragment, index of the slice)
    stacked_params = {
        "q_proj": ("qkv_proj", 0),
        "k_proj": ("qkv_proj", 1),
        "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0),
        "up_proj": ("gate_up_proj", 1),
    }

    def __init__(self, config: ModelConfig, max_positions: int):
        super().__init__()
        self.config = config
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(LlamaDecoderLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, max_positions)

    def forward(self, input_ids, positions, meta: AttentionMetadata, logits_indices) -> torch.Tensor:
        """Logits (float32) of the tokens at `logits_indices` of the flattened batch."""
        hidden = self.embed_tokens(input_ids)
        # Per-step work that every layer shares is done once here.
        rope = self.rotary.cos_sin(positions, hidden.dtype)
        meta = prepare_metadata(meta, self.config.num_kv_heads)
        for layer in self.layers:
            hidden = layer(rope, hidden, meta)
        hidden = self.norm(hidden).reshape(-1, self.config.hidden_size).index_select(0, logits_indices)
        return self.lm_head(hidden).float()

    def bind_kv_cache(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, cache in zip(self.layers, caches, strict=True):
            layer.self_attn.kv_cache = cache

    def fused_slice(self, param_name: str, shard: int) -> tuple[int, int]:
        """Row range of slice `shard` inside a fused q/k/v or gate/up weight."""
        if "qkv_proj" in param_name:
            attn = self.layers[0].self_attn
            sizes = [attn.q_size, attn.kv_size, attn.kv_size]
        else:
            sizes = [self.config.intermediate_size] * 2
        start = sum(sizes[:shard])
        return start, start + sizes[shard]
