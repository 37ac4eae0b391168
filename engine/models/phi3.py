"""Phi-3: the Llama decoder whose checkpoints store q/k/v and gate/up already fused.

Its fused tensors are split into our per-part layout on load, so each rank reads only its own
heads' rows of q, k and v (and of gate and up) out of the stacked tensor. Its `longrope` (`su`)
rope scaling and partial rotary factor are handled by engine/layers/rotary.py.
"""
from engine.layers.linear import STACKED
from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    stacked_params = {}

    def checkpoint_target(self, name: str):
        module, _, kind = name.rpartition(".")
        if module.endswith((".qkv_proj", ".gate_up_proj")):
            return module, kind, STACKED
        return module, kind, None
