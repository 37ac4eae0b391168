"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3, SmolLM), tensor-parallel, and the
building blocks the other native families (Gemma, Phi-3, the MoE models) reuse.

The architectures differ only in flags of ModelConfig (q/k/v biases, per-head q/k norms, rope
schedule, sliding-window layers, tied embeddings), so one module serves them all. q/k/v and gate/up
are fused into one matmul each: fewer, larger GEMMs are faster on every device. With several
shards, attention heads and the MLP are split Megatron-style (column-parallel in, row-parallel out)
and the vocabulary is split too.
"""

from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention import (
    AttentionMetadata,
    DecodeMetadata,
    attention,
    prepare_metadata,
    windowed_metadata,
)
from engine.devices.hooks import mark_step
from engine.distributed import SINGLE, Parallel
from engine.layers.activation import activation
from engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from engine.layers.linear import RowParallelLinear, merged_parallel, qkv_parallel
from engine.layers.norm import RMSNorm, rms_norm
from engine.layers.rotary import RotaryEmbedding, apply_rotary
from engine.models.config import FULL, SLIDING, ModelConfig


class LayerContext(NamedTuple):
    """What every layer of one attention type shares in a forward: rope cos/sin and attention
    metadata."""

    rope: tuple[torch.Tensor, torch.Tensor]
    meta: AttentionMetadata


class LlamaAttention(nn.Module):
    # A device kernel with apply_rotary's contract, fn(q, k, cos, sin), set by the device adapter
    # (the CPU one's engine.devices.cpu.kernels); None runs apply_rotary.
    fused_rotary = None

    def __init__(self, config: ModelConfig, parallel: Parallel, layer: int = 0):
        super().__init__()
        self.head_dim = config.head_dim
        self.qkv_proj = qkv_parallel(
            config.hidden_size,
            config.head_dim,
            config.num_heads,
            config.num_kv_heads,
            config.qkv_bias,
            parallel,
        )
        self.q_size = self.qkv_proj.parts["q"][2]
        self.kv_size = self.qkv_proj.parts["k"][2]
        self.num_heads, self.num_kv_heads = (
            self.q_size // self.head_dim,
            self.kv_size // self.head_dim,
        )
        self.scale = config.attention_scale
        self.window = config.window_of(layer) if config.layer_types else None
        self.softcap = config.attn_softcap
        self.o_proj = RowParallelLinear(
            config.num_heads * config.head_dim, config.hidden_size, config.o_bias, parallel
        )
        if config.qk_norm:  # per head, so the same weights serve every rank's heads
            self.q_norm = rms_norm(config.head_dim, config.rms_norm_eps, config.gemma_norms)
            self.k_norm = rms_norm(config.head_dim, config.rms_norm_eps, config.gemma_norms)
        self.kv_cache: tuple[torch.Tensor, torch.Tensor] | None = None  # bound by the KV cache

    def forward(self, context: LayerContext, hidden, lora=None):
        q, k, v = self.qkv_proj(hidden, lora).split(
            [self.q_size, self.kv_size, self.kv_size], dim=-1
        )
        lead = hidden.shape[:-1]
        q = q.view(*lead, self.num_heads, self.head_dim)
        k = k.view(*lead, self.num_kv_heads, self.head_dim)
        v = v.view(*lead, self.num_kv_heads, self.head_dim)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = (self.fused_rotary or apply_rotary)(q, k, *context.rope)
        out = attention(q, k, v, self.kv_cache, context.meta, self.scale, self.window, self.softcap)
        return self.o_proj(out.reshape(*lead, self.q_size), lora)


class LlamaMLP(nn.Module):
    # A device kernel fn(gate_up) = act(gate) * up, set by the device adapter for SiLU MLPs (the
    # CPU one's engine.devices.cpu.kernels); None runs the torch ops.
    fused_act_and_mul = None

    def __init__(
        self, config: ModelConfig, parallel: Parallel, intermediate_size: int | None = None
    ):
        super().__init__()
        intermediate = intermediate_size or config.intermediate_size
        self.act = activation(config.hidden_act)
        self.gate_up_proj = merged_parallel(
            config.hidden_size, intermediate, ["gate", "up"], config.mlp_bias, parallel
        )
        self.down_proj = RowParallelLinear(
            intermediate, config.hidden_size, config.mlp_bias, parallel
        )

    def forward(self, x, lora=None):
        gate_up = self.gate_up_proj(x, lora)
        if self.fused_act_and_mul is not None:
            return self.down_proj(self.fused_act_and_mul(gate_up), lora)
        gate, up = gate_up.chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up, lora)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, config: ModelConfig, parallel: Parallel, layer: int, make_mlp):
        super().__init__()
        self.self_attn = LlamaAttention(config, parallel, layer)
        self.mlp = make_mlp(config, parallel, layer)  # the model's: dense, or a MoE block
        self.input_layernorm = rms_norm(config.hidden_size, config.rms_norm_eps, config.gemma_norms)
        self.post_attention_layernorm = rms_norm(
            config.hidden_size, config.rms_norm_eps, config.gemma_norms
        )

    def forward(self, context: LayerContext, hidden, lora=None):
        hidden = hidden + self.self_attn(context, self.input_layernorm(hidden), lora)
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
    decoder_layer = LlamaDecoderLayer
    stage = None  # engine.pipeline.stage.PipelineStage when this model is one stage of a pipeline
    # EAGLE-3 (engine/speculative/eagle3.py): the layers (distinct, ascending) whose input, the
    # residual stream entering them (vLLM's `hidden_states + residual`), every forward stores
    # concatenated in `aux_cache` at the tokens' KV slots: one in-graph write at the bucket's shape,
    # as the KV cache's own.
    aux_layers: tuple[int, ...] = ()
    aux_cache: torch.Tensor | None = None  # [KV slots, len(aux_layers) * hidden]
    # A device kernel that runs every layer of a forward at once, fn(hidden, rope, meta) -> hidden,
    # or None where it does not take that forward; set by the device adapter where plain_decoder()
    # holds (the CPU one's engine.devices.cpu.kernels.FusedDecoder). None runs the layers one by
    # one.
    fused_decode = None
    # Likewise fn(hidden, logits_indices) -> the float32 logits of final_logits (norm and LM head)
    # in one call, or None where it does not take them.
    fused_final = None

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        parallel: Parallel = SINGLE,
        moe_impl: str = "dense",
    ):
        super().__init__()
        self.config, self.parallel, self.moe_impl = config, parallel, moe_impl
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
        self.layers = nn.ModuleList(
            self.decoder_layer(config, parallel, i, self.make_mlp) for i in range(config.num_layers)
        )
        self.norm = rms_norm(config.hidden_size, config.rms_norm_eps, config.gemma_norms)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, parallel)
        if config.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, max_positions)
        if config.local_rope is not None:
            self.local_rotary = RotaryEmbedding(config.local_rope, config.head_dim, max_positions)
        self.local_kv_heads = self.layers[0].self_attn.num_kv_heads
        self.lora_set = None  # LoraSet of the served adapters, set by engine.weights.lora

    def make_mlp(self, config: ModelConfig, parallel: Parallel, layer: int) -> nn.Module:
        return LlamaMLP(config, parallel)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.embed_tokens(input_ids)

    def forward(
        self, input_ids, positions, meta: AttentionMetadata, logits_indices, lora_index=None
    ) -> torch.Tensor:
        """Logits (float32, full vocabulary) of the tokens at `logits_indices` of the flattened
        batch. `lora_index`: each token's adapter slot (-1: none), shaped like input_ids; None
        without adapters."""
        if self.stage is not None:  # one stage of a pipeline (engine/pipeline/stage.py)
            return self.stage.forward(self, input_ids, positions, meta, logits_indices, lora_index)
        hidden = self.run_layers(self.embed(input_ids), positions, meta, lora_index)
        return self.final_logits(hidden, logits_indices)

    def run_layers(self, hidden, positions, meta: AttentionMetadata, lora_index=None):
        """The decoder layers over the embedded tokens (or a previous stage's output)."""
        contexts = self.layer_contexts(positions, meta, hidden.dtype)
        if self.fused_decode is not None and lora_index is None and not self.aux_layers:
            fused = self.fused_decode(hidden, contexts[FULL].rope, contexts[FULL].meta)
            if fused is not None:
                return fused
        lora = None if lora_index is None else self.lora_set.selector(lora_index, hidden.dtype)
        taken = []
        kinds = self.config.layer_types or (FULL,) * len(self.layers)
        for index, (layer, kind) in enumerate(zip(self.layers, kinds)):
            if index in self.aux_layers:
                taken.append(hidden)
            hidden = layer(contexts[kind], hidden, lora)
            mark_step()  # HPU lazy mode: a graph per layer compiles far faster than one per model
        if taken and self.aux_cache is not None:
            aux = torch.cat(taken, dim=-1).reshape(-1, self.aux_cache.shape[1])
            self.aux_cache.index_copy_(0, meta.slots.reshape(-1), aux.to(self.aux_cache.dtype))
        return hidden

    def plain_decoder(self) -> bool:
        """Whether every layer is the plain pre-norm Llama layer, which a fused decode kernel may
        run in place of the modules: RMS norms, full attention with whole-head rope and no q/k
        norms, cap or output bias, a SiLU MLP without biases, one shard, no pipeline stage."""
        config = self.config
        plain_config = (
            self.parallel.world_size == 1
            and self.stage is None
            and SLIDING not in config.layer_types
            and not (config.qk_norm or config.gemma_norms or config.o_bias or config.mlp_bias)
            and config.attn_softcap is None
            and config.rope.rotary_dim(config.head_dim) == config.head_dim
        )
        return plain_config and all(
            type(layer) is LlamaDecoderLayer
            and type(layer.self_attn) is LlamaAttention
            and type(layer.mlp) is LlamaMLP
            and layer.mlp.act is F.silu
            and type(layer.input_layernorm) is type(layer.post_attention_layernorm) is RMSNorm
            for layer in self.layers
        )

    def final_logits(self, hidden, logits_indices) -> torch.Tensor:
        if self.fused_final is not None:  # the device's norm and LM head in one call
            logits = self.fused_final(hidden, logits_indices)
            if logits is not None:
                return logits
        hidden = (
            self.norm(hidden).reshape(-1, self.config.hidden_size).index_select(0, logits_indices)
        )
        logits = self.lm_head.logits(hidden).float()
        cap = self.config.final_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def layer_contexts(self, positions, meta: AttentionMetadata, dtype) -> dict[str, LayerContext]:
        """Per-step work that every layer of a type shares, done once here."""
        rope = self.rotary.cos_sin(positions, dtype, _last_positions(meta))
        meta = prepare_metadata(meta, self.local_kv_heads)
        contexts = {FULL: LayerContext(rope, meta)}
        if SLIDING in self.config.layer_types:
            local_rope = (
                self.local_rotary.cos_sin(positions, dtype, _last_positions(meta))
                if hasattr(self, "local_rotary")
                else rope
            )
            if isinstance(meta, DecodeMetadata):
                meta = windowed_metadata(
                    meta, positions, self.config.sliding_window, self.local_kv_heads
                )
            contexts[SLIDING] = LayerContext(local_rope, meta)
        return contexts

    def bind_kv_cache(self, caches: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        for layer, cache in zip(self.layers, caches, strict=True):
            layer.self_attn.kv_cache = cache
        self.aux_cache = None
        if self.aux_layers and caches[0] is not None:  # one row per KV slot, as the cache has
            keys = caches[0][0]
            width = len(self.aux_layers) * self.config.hidden_size
            self.aux_cache = torch.zeros(
                (keys.shape[0], width), dtype=self.norm.weight.dtype, device=keys.device
            )

    def rebuild_rotary(self, max_positions: int, device) -> None:
        """Recompute the rope tables after the model was allocated on the meta device."""
        self.rotary = RotaryEmbedding(self.config.rope, self.config.head_dim, max_positions).to(
            device
        )
        if self.config.local_rope is not None:
            self.local_rotary = RotaryEmbedding(
                self.config.local_rope, self.config.head_dim, max_positions
            ).to(device)

    def checkpoint_target(self, name: str) -> tuple[str, str, object]:
        """(our module path, parameter name, fused part or None) for a checkpoint tensor name."""
        for fragment, (fused, part) in self.stacked_params.items():
            if f".{fragment}." in name:
                module, _, kind = name.replace(fragment, fused).rpartition(".")
                return module, kind, part
        module, _, kind = name.rpartition(".")
        return module, kind, None


def _last_positions(meta: AttentionMetadata) -> torch.Tensor | None:
    """[rows, 1] last real position of each prefill row (padding past it has later positions), for
    rope schedules chosen per sequence; decode rows are their own last position (None)."""
    if isinstance(meta, DecodeMetadata) or getattr(meta, "seq_lens", None) is None:
        return None
    return (meta.seq_lens - 1).unsqueeze(1)
