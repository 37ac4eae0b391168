"""Tensor-parallel linear layers (Megatron-style).

Column-parallel layers split their outputs over the ranks, row-parallel layers their inputs (and
sum the partial products with an all-reduce). Each `load` reads only this rank's rows or columns
of a checkpoint tensor: `source` is a safetensors slice (or a tensor), indexed before it is read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import Parallel, all_reduce_sum
from engine.errors import ModelLoadError

STACKED = "stacked"  # a checkpoint tensor that holds every part of a fused module, in order (Phi-3)


def shape_of(source) -> tuple[int, ...]:
    return tuple(source.get_shape()) if hasattr(source, "get_shape") else tuple(source.shape)


def copy_checked(dest: torch.Tensor, source, index, full_shape: tuple[int, ...], name: str) -> None:
    """Copy `source[index]` into dest after checking the checkpoint tensor's full shape."""
    if shape_of(source) != full_shape:
        raise ModelLoadError(
            f"checkpoint tensor {name!r} has shape {shape_of(source)}, expected {full_shape}"
        )
    with torch.no_grad():
        dest.copy_(torch.as_tensor(source[index]))


def project(layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias), through the layer's quantized weight when it has one."""
    if layer.quantized is None:
        return dense_linear(x, layer.weight, bias)
    out = layer.quantized.linear(x)
    return out if bias is None else out + bias


def is_lone_reduced_row(x: torch.Tensor) -> bool:
    """One row (a lone decode) in bfloat16/float16."""
    return x.dim() == 2 and x.shape[0] == 1 and x.dtype in (torch.bfloat16, torch.float16)


def dense_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """x @ weight.T (+ bias). A lone bfloat16/float16 row goes through matrix-vector: torch's
    reduced-precision GEMV reads the weight once with float32 accumulation, where F.linear takes a
    GEMM path that is far slower on CPU (a batch-1 step's weights: 22 ms there, 15.4 ms here)."""
    if not is_lone_reduced_row(x):
        return F.linear(x, weight, bias)
    out = torch.mv(weight, x[0]).unsqueeze(0)
    return out if bias is None else out + bias


class ColumnParallelLinear(nn.Module):
    """Outputs made of named parts (q, k, v or gate, up), each split over the ranks.

    `parts` maps a part to (global rows, first row of this rank, rows on this rank)."""

    def __init__(self, in_features: int, parts: dict[str, tuple[int, int, int]], bias: bool):
        super().__init__()
        self.in_features, self.parts = in_features, parts
        self.offsets, offset = {}, 0
        for name, (_, _, local) in parts.items():
            self.offsets[name] = offset
            offset += local
        self.weight = nn.Parameter(torch.empty(offset, in_features))
        self.bias = nn.Parameter(torch.empty(offset)) if bias else None
        self.lora = None  # LoraWeights, attached by engine.weights.lora when adapters are loaded
        self.quantized = (
            None  # Int8Weight or Int4Weight (engine.weights.quantize), which then replaces `weight`
        )

    def forward(self, x: torch.Tensor, lora: torch.Tensor | None = None) -> torch.Tensor:
        """`lora`: the forward's adapter selector (engine.layers.lora), None without adapters."""
        out = project(self, x, self.bias)
        return out if lora is None or self.lora is None else self.lora.add_to(out, x, lora)

    def load(self, kind: str, part: str, source, name: str) -> None:
        rows, start, local = self.parts[part]
        dest = getattr(self, kind)[self.offsets[part] : self.offsets[part] + local]
        full = (rows, self.in_features) if kind == "weight" else (rows,)
        copy_checked(dest, source, slice(start, start + local), full, name)

    def load_stacked(self, kind: str, source, name: str) -> None:
        """A checkpoint tensor holding every part stacked in order (Phi-3's qkv_proj, gate_up_proj):
        each part's slice of this rank is read at that part's offset in the stack."""
        total = sum(rows for rows, _, _ in self.parts.values())
        full = (total, self.in_features) if kind == "weight" else (total,)
        if shape_of(source) != full:
            raise ModelLoadError(
                f"checkpoint tensor {name!r} has shape {shape_of(source)}, expected {full}"
            )
        base = 0
        for part, (rows, start, local) in self.parts.items():
            dest = getattr(self, kind)[self.offsets[part] : self.offsets[part] + local]
            with torch.no_grad():
                dest.copy_(torch.as_tensor(source[base + start : base + start + local]))
            base += rows


def qkv_parallel(
    hidden: int, head_dim: int, heads: int, kv_heads: int, bias: bool, parallel: Parallel
) -> ColumnParallelLinear:
    """q/k/v projection; kv heads are split, or replicated when there are fewer than ranks."""
    local_heads = parallel.split(heads, "attention heads")
    local_kv, first_kv = kv_partition(kv_heads, parallel)
    return ColumnParallelLinear(
        hidden,
        {
            "q": (heads * head_dim, parallel.rank * local_heads * head_dim, local_heads * head_dim),
            "k": (kv_heads * head_dim, first_kv * head_dim, local_kv * head_dim),
            "v": (kv_heads * head_dim, first_kv * head_dim, local_kv * head_dim),
        },
        bias,
    )


def kv_partition(kv_heads: int, parallel: Parallel) -> tuple[int, int]:
    """(kv heads on this rank, index of its first). With fewer kv heads than ranks, each kv head
    is replicated on world_size / kv_heads consecutive ranks (the ranks whose query heads use
    it)."""
    if kv_heads >= parallel.world_size:
        local = parallel.split(kv_heads, "key/value heads")
        return local, parallel.rank * local
    if parallel.world_size % kv_heads:
        raise ValueError(
            f"key/value heads ({kv_heads}) cannot be replicated over {parallel.world_size} shards"
        )
    return 1, parallel.rank * kv_heads // parallel.world_size


def merged_parallel(
    in_features: int, out_features: int, names: list[str], bias: bool, parallel: Parallel
) -> ColumnParallelLinear:
    """Equal-sized parts (gate and up) fused into one column-parallel matmul."""
    local = parallel.split(out_features, "intermediate size")
    return ColumnParallelLinear(
        in_features, {n: (out_features, parallel.rank * local, local) for n in names}, bias
    )


class RowParallelLinear(nn.Module):
    """Input split over the ranks; the partial outputs are summed, then the bias added once."""

    def __init__(self, in_features: int, out_features: int, bias: bool, parallel: Parallel):
        super().__init__()
        self.parallel, self.out_features = parallel, out_features
        self.local_in = parallel.split(in_features, "projection input")
        self.weight = nn.Parameter(torch.empty(out_features, self.local_in))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.lora = (
            None  # LoraWeights over this rank's input columns, attached by engine.weights.lora
        )
        self.quantized = None  # as in ColumnParallelLinear

    def forward(self, x: torch.Tensor, lora: torch.Tensor | None = None) -> torch.Tensor:
        out = project(self, x, None)
        if lora is not None and self.lora is not None:
            # A partial LoRA delta (this rank's columns of A) joins the partial product: one
            # all-reduce sums both.
            out = self.lora.add_to(out, x, lora)
        out = all_reduce_sum(out, self.parallel)
        return out + self.bias if self.bias is not None else out

    def load(self, kind: str, part, source, name: str) -> None:
        if kind == "bias":
            copy_checked(self.bias, source, slice(None), (self.out_features,), name)
            return
        start = self.parallel.rank * self.local_in
        full = (self.out_features, self.local_in * self.parallel.world_size)
        copy_checked(
            self.weight, source, (slice(None), slice(start, start + self.local_in)), full, name
        )
