"""Gemma 2 and Gemma 3 (text): the Llama decoder with Gemma's differences.

- embeddings scaled by sqrt(hidden_size), rounded to the model's dtype as the reference does;
- (1 + weight) RMSNorms, and norms after attention and around the MLP ("sandwich" norms);
- a tanh-approximated GELU MLP, the attention scale from `query_pre_attn_scalar`;
- Gemma 2: soft-capped attention scores and final logits;
- alternating sliding-window and global layers (the window really applied, in prefill and in
  flat decode through the block bias), and for Gemma 3 per-head q/k norms and a separate rope
  base for the sliding layers.
All of these are switches of ModelConfig read by the shared building blocks.
"""

import torch

from engine.layers.norm import rms_norm
from engine.models.llama import LayerContext, LlamaDecoderLayer, LlamaForCausalLM


class GemmaDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config, parallel, layer, make_mlp):
        super().__init__(config, parallel, layer, make_mlp)
        self.pre_feedforward_layernorm = rms_norm(config.hidden_size, config.rms_norm_eps, True)
        self.post_feedforward_layernorm = rms_norm(config.hidden_size, config.rms_norm_eps, True)

    def forward(self, context: LayerContext, hidden, lora=None):
        attended = self.self_attn(context, self.input_layernorm(hidden), lora)
        hidden = hidden + self.post_attention_layernorm(attended)
        return hidden + self.post_feedforward_layernorm(
            self.mlp(self.pre_feedforward_layernorm(hidden), lora)
        )


class GemmaForCausalLM(LlamaForCausalLM):
    decoder_layer = GemmaDecoderLayer

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(input_ids)
        return hidden * torch.tensor(
            self.config.hidden_size**0.5, dtype=hidden.dtype, device=hidden.device
        )
