"""Pre-quantized FP8 weights (float8_e4m3fn with `weight_scale`, as llm-compressor and FBGEMM-style
checkpoints store them): w = weight * scale per output row.

A per-tensor scale is stored per row too, so a fused q/k/v keeps each part's own scale. The scales
are tensors (buffers), so a captured graph takes them as inputs and never recompiles for them.
`linear` here is the reference: dequantize, then multiply in the activation dtype. HPU and CUDA
run FP8 matmuls natively; their kernels belong under engine/devices/ (not written yet).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

FP8 = torch.float8_e4m3fn


class Fp8Weight(nn.Module):
    kind = "fp8"

    def __init__(self, weight: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        if weight.dtype != FP8:
            raise ValueError(f"an FP8 checkpoint weight must be float8_e4m3fn, not {weight.dtype}")
        self.out_features, self.in_features = weight.shape
        self.register_buffer("weight", weight.contiguous())
        self.register_buffer("scale", scale.float().reshape(-1).contiguous())

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.dequantize().to(x.dtype))

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scale.unsqueeze(1)


def row_scales(scale: torch.Tensor, rows: int) -> torch.Tensor:
    """A checkpoint's weight_scale (per tensor: one value; per channel: [rows] or [rows, 1]) per
    row."""
    if scale.numel() == 1:
        return scale.float().reshape(1).expand(rows).clone()
    if scale.numel() != rows:
        raise ValueError(
            f"weight_scale has {scale.numel()} values for {rows} rows (expected 1 or {rows})"
        )
    return scale.float().reshape(rows)
