"""FP8 weights (engine/layers/fp8.py) multiplied natively: Gaudi's fp8_gemm_v2 and CUDA's
torch._scaled_mm, both with per-row weight scales and a per-token dynamic scale of the activations.

- HPU, as vllm-hpu-extension's apply_fp8_linear_hpu (ops.py, v1.22.0 @8211e0b): the activation is
  cast by torch.ops.hpu.cast_to_fp8_v2 with its row's amax / FP8_MAX, then
  torch.ops.hpu.fp8_gemm_v2(A=x, B=weight, trans_B=True, A_scale_inv, B_scale_inv). Gaudi 2's fp8
  is e4m3 with a range of +-240 (the extension's FP8_MAX is float8_e4m3fnuz's max there), not
  e4m3fn's +-448: the weights are quantized again per row into +-240 when the model is prepared.
- CUDA, torch._scaled_mm with row-wise scales (scale_a [tokens, 1], scale_b [1, out], float32,
  bfloat16 out): it needs compute capability 8.9 or later and every matrix dimension but the
  tokens divisible by 16; a layer that does not qualify dequantizes (on the device) instead.
"""

from __future__ import annotations

import torch

from engine.layers.fp8 import FP8, Fp8Weight

E4M3FN_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
GAUDI2_MAX = torch.finfo(torch.float8_e4m3fnuz).max  # 240
SCALED_MM_CAPABILITY = (8, 9)


def row_quantize(values: torch.Tensor, limit: float) -> tuple[torch.Tensor, torch.Tensor]:
    """values [rows, columns] as FP8 within +-limit, and the float32 scale of each row."""
    scale = (values.abs().amax(dim=-1).float() + 1e-12) / limit
    return (values / scale.unsqueeze(-1)).clamp(-limit, limit).to(FP8), scale


class HPUFp8Weight(Fp8Weight):
    limit: float = E4M3FN_MAX  # GAUDI2_MAX on Gaudi 2

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1])
        x_scale = (rows.abs().amax(dim=-1, keepdim=True).float() + 1e-8) / self.limit
        x_fp8 = torch.ops.hpu.cast_to_fp8_v2(rows, 1.0 / x_scale, False, False, FP8)[0]
        out = torch.ops.hpu.fp8_gemm_v2(
            A=x_fp8,
            trans_A=False,
            B=self.weight,
            trans_B=True,
            D=None,
            out_dtype=x.dtype,
            A_scale_inv=x_scale,
            B_scale_inv=self.scale,
            bias=None,
            accumulate=False,
        )
        return out.view(*x.shape[:-1], self.out_features)


class CUDAFp8Weight(Fp8Weight):
    native: bool = True  # False: dimensions torch._scaled_mm refuses

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        if not self.native:
            return super().linear(x)
        rows = x.reshape(-1, x.shape[-1]).to(torch.bfloat16)
        x_scale = (rows.abs().amax(dim=-1, keepdim=True).float() + 1e-8) / E4M3FN_MAX
        x_fp8 = (rows / x_scale).clamp(-E4M3FN_MAX, E4M3FN_MAX).to(FP8)
        out = torch._scaled_mm(
            x_fp8,
            self.weight.t(),  # column-major, as cuBLASLt needs the second operand
            scale_a=x_scale,
            scale_b=self.scale.view(1, -1),
            out_dtype=torch.bfloat16,
        )
        return out.to(x.dtype).view(*x.shape[:-1], self.out_features)


def fp8_weights(model) -> list[Fp8Weight]:
    return [m for m in model.modules() if type(m) is Fp8Weight]


def prepare_hpu(model, device: torch.device, gaudi2: bool) -> int:
    """Every Fp8Weight of `model` on the device, multiplied by fp8_gemm_v2. Returns how many."""
    weights = fp8_weights(model)
    for module in weights:
        module.to(device)
        module.__class__ = HPUFp8Weight
        if gaudi2:  # e4m3fn codes past +-240 are out of Gaudi 2's range: quantize again
            module.weight, module.scale = row_quantize(module.dequantize(), GAUDI2_MAX)
            module.limit = GAUDI2_MAX
    return len(weights)


def prepare_cuda(model, device: torch.device, capability: tuple[int, int]) -> int:
    """Every Fp8Weight of `model` on the device, through torch._scaled_mm where it qualifies."""
    weights = fp8_weights(model)
    for module in weights:
        module.to(device)
        module.__class__ = CUDAFp8Weight
        module.native = (
            capability >= SCALED_MM_CAPABILITY
            and module.in_features % 16 == 0
            and module.out_features % 16 == 0
        )
    return len(weights)
