"""Weight-only quantized weights, run by PyTorch's own packed CPU kernels.

- Int8Weight: one scale per output row, w = codes * scale (aten._weight_int8pack_mm). Its codes are
  plain int8 rows, so it also serves embedding lookups (a tied LM head and embedding share one).
- Int4Weight: groups of `group` inputs with a scale and a zero each, w = (codes - 8) * scale + zero
  (aten._weight_int4pack_mm_for_cpu's convention; GGUF's Q4_1 q*d+m is zero = m + 8d, Q4_0 zero =
  0).

Activations run in the dtype the scales were stored in (the model's): the kernels require it, and
they are fast only with bfloat16 activations (float32 is exact and slow, for tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

INT4_GROUP = 32  # GGUF's block size, and the group of our own int4 quantization
INT4_ROW_MULTIPLE = 16  # the CPU int4 packer requires the row count to be a multiple of 16
# Above this many rows (a prefill), dequantizing the weight once and running one bfloat16 GEMM beats
# the packed kernels, whose cost grows with every row (measured, one thread, all 30 layers of the
# embedded model: int4 kernel about 3.3 ms a row, dequantize-then-GEMM about 0.5 s whatever the
# rows).
DEQUANTIZE_ROWS = 128


class Int8Weight(nn.Module):
    kind = "int8"

    def __init__(self, codes: torch.Tensor, scale: torch.Tensor):
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.register_buffer("codes", codes.to(torch.int8).contiguous())
        self.register_buffer("scale", scale.contiguous())

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.scale.dtype)
        if flat.shape[0] > DEQUANTIZE_ROWS:
            out = F.linear(flat, self.codes.to(flat.dtype) * self.scale.unsqueeze(1))
        else:
            out = torch.ops.aten._weight_int8pack_mm(flat, self.codes, self.scale)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def rows(self, ids: torch.Tensor) -> torch.Tensor:
        """Embedding lookup: the dequantized rows of `ids`."""
        return F.embedding(ids, self.codes).to(self.scale.dtype) * F.embedding(
            ids, self.scale.unsqueeze(1)
        )

    def dequantize(self) -> torch.Tensor:
        return self.codes.float() * self.scale.float().unsqueeze(1)


class Int4Weight(nn.Module):
    kind = "int4"

    def __init__(
        self,
        codes: torch.Tensor,
        scale: torch.Tensor,
        zero: torch.Tensor,
        group: int,
        dtype: torch.dtype,
    ):
        """codes [N, K] in 0..15; scale and zero [N, K // group]."""
        super().__init__()
        self.out_features, self.in_features = codes.shape
        self.group = group
        pad = -self.out_features % INT4_ROW_MULTIPLE  # zero rows, cut from the output
        if pad:
            codes = F.pad(codes, (0, 0, 0, pad), value=8)
            scale, zero = F.pad(scale, (0, 0, 0, pad)), F.pad(zero, (0, 0, 0, pad))
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            codes.to(torch.int32).contiguous(), 1
        )
        self.register_buffer("packed", packed)
        # [K // group, N, 2]: the kernel's layout of the scales and zeros
        self.register_buffer(
            "scale_zero", torch.stack([scale.t(), zero.t()], -1).to(dtype).contiguous()
        )
        # The packed layout is the kernel's own and follows the CPU torch runs on; where one of our
        # readings reproduces the codes, large batches dequantize from it (else they stay on it).
        self.layout = int4_layout(packed, codes.to(torch.uint8))
        self.unpackable = self.layout is not None

    def linear(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(self.scale_zero.dtype)
        if flat.shape[0] > DEQUANTIZE_ROWS and self.unpackable:
            out = F.linear(flat, self.dequantized(flat.dtype))
        else:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(
                flat, self.packed, self.group, self.scale_zero
            )
        return out[:, : self.out_features].reshape(*x.shape[:-1], self.out_features).to(x.dtype)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        """The padded weight in `dtype`, unpacked from the kernel's layout."""
        rows = self.packed.shape[0]
        codes = unpack_int4(self.packed, self.in_features, self.layout)
        codes = codes.view(rows, -1, self.group).to(dtype)
        scale, zero = (self.scale_zero[..., i].t().unsqueeze(-1).to(dtype) for i in (0, 1))
        return ((codes - 8) * scale + zero).view(rows, self.in_features)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight the kernel multiplies by: unpacked where the layout check passed, else
        read back through the kernel itself with an identity input (slow with float32
        activations)."""
        if self.unpackable:
            return self.dequantized(torch.float32)[: self.out_features].contiguous()
        eye = torch.eye(self.in_features)
        columns = torch.ops.aten._weight_int4pack_mm_for_cpu(
            eye, self.packed, self.group, self.scale_zero.float()
        )
        return columns.t()[: self.out_features].contiguous()


# _convert_weight_to_int4pack_for_cpu's layouts (torch 2.13,
# aten/src/ATen/native/cpu/int4mm_kernel.cpp, weight_to_int4pack_kernel), as (rows a block, halves):
# per block, a [K, rows / 2] byte array. With halves, byte j holds row j in its low nibble and row j
# + rows / 2 in its high one; without, rows 2j and 2j + 1. AVX512 builds pack blocks of 64 rows in
# halves, AVX2 builds 32, the rest 32 in pairs; a last, partial block is always in pairs.
INT4_LAYOUTS = ((64, True), (32, True), (32, False))


def int4_layout(packed: torch.Tensor, codes: torch.Tensor) -> tuple[int, bool] | None:
    """The layout of INT4_LAYOUTS that reads `packed` back as `codes`, or None."""
    cols = codes.shape[1]
    for layout in INT4_LAYOUTS:
        if torch.equal(unpack_int4(packed, cols, layout), codes):
            return layout
    return None


def unpack_int4(packed: torch.Tensor, cols: int, layout: tuple[int, bool]) -> torch.Tensor:
    """Codes [N, K] from _convert_weight_to_int4pack_for_cpu's `layout` (see INT4_LAYOUTS)."""
    block, halves = layout
    full = packed.shape[0] - packed.shape[0] % block
    return torch.cat(
        [
            unpack_blocks(packed[:full], cols, block, halves),
            unpack_blocks(packed[full:], cols, packed.shape[0] - full, halves=False),
        ]
    )


def unpack_blocks(packed: torch.Tensor, cols: int, block: int, halves: bool) -> torch.Tensor:
    if packed.shape[0] == 0:
        return packed.new_empty(0, cols)
    blocks = packed.reshape(-1, cols, block // 2)
    low, high = blocks & 0x0F, blocks >> 4
    if halves:
        codes = torch.cat([low, high], dim=-1)
    else:
        codes = torch.stack([low, high], dim=-1).flatten(2)
    return codes.permute(0, 2, 1).reshape(-1, cols)  # [blocks, K, rows] -> [N, K]


def int8_per_channel(weight: torch.Tensor, dtype: torch.dtype) -> Int8Weight:
    """Symmetric int8, one scale per output row (max |w| maps to 127)."""
    weight = weight.float()
    scale = (weight.abs().amax(1).clamp(min=1e-8) / 127).to(dtype)
    codes = torch.round(weight / scale.float().unsqueeze(1)).clamp(-127, 127)
    return Int8Weight(codes, scale)


def int4_groupwise(weight: torch.Tensor, dtype: torch.dtype, group: int = INT4_GROUP) -> Int4Weight:
    """Asymmetric int4 per group of `group` inputs: each group's [min, max] spans codes 0..15."""
    return Int4Weight(*int4_codes(weight, dtype, group), group, dtype)


def int4_codes(weight: torch.Tensor, dtype: torch.dtype, group: int = INT4_GROUP) -> tuple:
    """int4_groupwise's codes [N, K] (0..15, float), scales and zeros [N, K // group] (float32
    values that `dtype` holds exactly)."""
    rows, cols = weight.shape
    if cols % group:
        raise ValueError(f"int4 needs input sizes divisible by the group of {group}, got {cols}")
    grouped = weight.float().reshape(rows, cols // group, group)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scale = ((high - low).clamp(min=1e-8) / 15).to(dtype).float()
    zero = (low + 8 * scale).to(dtype).float()  # the kernel's zero is the value of code 8
    codes = torch.round((grouped - (zero - 8 * scale).unsqueeze(-1)) / scale.unsqueeze(-1)).clamp(
        0, 15
    )
    return codes.reshape(rows, cols), scale, zero


def weight_bytes(module: nn.Module) -> int:
    """Bytes of every parameter and buffer (each storage once): the resident size of the weights."""
    seen, total = set(), 0
    for tensor in list(module.parameters()) + list(module.buffers()):
        key = tensor.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += tensor.untyped_storage().nbytes()
    return total
