"""Phi-3: the Llama decoder whose checkpoints store q/k/v and gate/up already fused.

Its fused tensors are split into our per-part layout on load, so each rank reads only its own
heads' rows of q, k and v (and of gate and up) out of the stacked tensor. Its `longrope` (`su`)
rope scaling and partial rotary factor are handled by engine/layers/rotary.py.

transformers' Phi-3 drops its KV cache when a sequence first outgrows
original_max_position_embeddings (Phi3ForCausalLM.prepare_inputs_for_generation) and recomputes it
all with the long factors, which changes every layer's keys and values, not only their rotation.
`recompute_cache_at` names that position: the decode step that would feed it prefills the whole
sequence instead (engine/serving/recompute.py), so greedy tokens stay equal to transformers' past
the boundary.
"""

from engine.layers.linear import STACKED
from engine.models.llama import LlamaForCausalLM


class Phi3ForCausalLM(LlamaForCausalLM):
    stacked_params = {}

    @property
    def recompute_cache_at(self) -> int | None:
        rope = self.config.rope
        return rope.original_max_position_embeddings if rope.rope_type == "longrope" else None

    def checkpoint_target(self, name: str):
        module, _, kind = name.rpartition(".")
        if module.endswith((".qkv_proj", ".gate_up_proj")):
            return module, kind, STACKED
        return module, kind, None
