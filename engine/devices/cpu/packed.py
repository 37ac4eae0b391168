"""bfloat16 linear weights prepacked for oneDNN, the CPU adapter's form of a dense decoder
projection.

F.linear hands oneDNN a plain row-major weight on every call, which it reorders into its blocked
layout each time. Packing once at start (`torch.ops.mkldnn._reorder_linear_weight`, what inductor's
CPU freezing pass does) and multiplying with `_linear_pointwise` saves that: the decoder weights of
the embedded model at 2 to 48 rows took 15-18 ms a step packed against 21-31 ms through F.linear
(the 120 projection matrices of SmolLM2 in bf16, cold in cache, 2 threads, medians of 25 alternating
runs), the same as the lone-row GEMV at one row, and the results are bitwise equal to F.linear's up
to 32 rows. float32 is left as it is: there packing was slower at small batches.

The packed tensor replaces the plain weight (same bytes). The vocabulary matrices stay plain: the
LM head gained nothing packed, and the tied embedding needs plain rows for its lookup.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.layers.linear import ColumnParallelLinear, RowParallelLinear


class PackedBf16Weight(nn.Module):
    kind = "packed-bf16"

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # The batch-size hint 1 favours decode; prefill's large batches run about as fast as
        # F.linear.
        self.register_buffer(
            "packed", torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        )

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features)
        out = torch.ops.mkldnn._linear_pointwise(flat, self.packed, None, "none", [], "")
        return out.reshape(*x.shape[:-1], self.out_features)


def packing_available() -> bool:
    return torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()


def pack_linear_weights(model: nn.Module) -> int:
    """Pack every plain bfloat16 decoder projection of `model` in place; the number packed."""
    packed = 0
    for module in model.modules():
        if (
            isinstance(module, (ColumnParallelLinear, RowParallelLinear))
            and module.quantized is None
            and module.weight is not None
            and module.weight.dtype == torch.bfloat16
        ):
            module.quantized = PackedBf16Weight(module.weight)
            module.register_parameter("weight", None)
            packed += 1
    return packed
