"""Decoders whose MLPs are sparse mixture-of-experts blocks (Mixtral, Qwen3-MoE).

The experts run in static shapes (engine/layers/moe.py), `dense` or `gather` as the device
prefers. Checkpoints store one tensor per expert and projection; each is loaded into its slot of
our stacked expert weights, this rank's slice of the intermediate dimension only.
"""

import re

from engine.layers.activation import activation
from engine.layers.moe import SparseMoeBlock, moe_ops
from engine.models.llama import LlamaForCausalLM, LlamaMLP


class MoeForCausalLM(LlamaForCausalLM):
    # checkpoint name pattern of an expert's projection (groups: layer prefix, expert, projection)
    expert_pattern: re.Pattern
    router_name = ""  # the checkpoint's name of the MoE block ("block_sparse_moe", "mlp")
    projections = {}  # checkpoint projection -> (our parameter, part within an expert)

    def make_mlp(self, config, parallel, layer):
        moe = config.moe
        if not moe.sparse_layers[layer]:
            return LlamaMLP(config, parallel)
        return SparseMoeBlock(
            config.hidden_size,
            moe.intermediate_size,
            moe.num_experts,
            moe.top_k,
            moe.normalize_top_k,
            activation(config.hidden_act),
            parallel,
            moe_ops(self.moe_impl),
        )

    def checkpoint_target(self, name: str):
        match = self.expert_pattern.fullmatch(name)
        if match:
            prefix, expert, projection = match.groups()
            kind, part = self.projections[projection]
            return f"{prefix}.mlp", kind, (int(expert), part) if part else int(expert)
        name = name.replace(f".{self.router_name}.gate.", ".mlp.gate.")
        return super().checkpoint_target(name)


class MixtralForCausalLM(MoeForCausalLM):
    expert_pattern = re.compile(
        r"(layers\.\d+)\.block_sparse_moe\.experts\.(\d+)\.(w[123])\.weight"
    )
    router_name = "block_sparse_moe"
    projections = {"w1": ("gate_up", "gate"), "w3": ("gate_up", "up"), "w2": ("down", None)}


class Qwen3MoeForCausalLM(MoeForCausalLM):
    expert_pattern = re.compile(
        r"(layers\.\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"
    )
    router_name = "mlp"
    projections = {
        "gate_proj": ("gate_up", "gate"),
        "up_proj": ("gate_up", "up"),
        "down_proj": ("down", None),
    }
