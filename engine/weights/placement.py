"""Where and how one model's weights live: its dtype, device, tensor-parallel part, MoE kernel and
weight quantization, resolved once per model (the target's by the Shard, the draft's by its
loader) and handed to every loader as one value instead of a clump of positional parameters."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.distributed import SINGLE, Parallel


@dataclass(frozen=True)
class Placement:
    dtype: torch.dtype
    device: torch.device
    parallel: Parallel = SINGLE
    moe_impl: str = "dense"  # how MoE experts run (engine/layers/moe.py)
    quantize: str = "none"  # engine.weights.quantize.QUANTIZE_MODES
