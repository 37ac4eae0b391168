"""Multi-LoRA operations: one batch, each token with its own adapter (or none).

A LoRA-adapted projection computes `out = x·Wᵀ + scale · (x·Aᵀ)·Bᵀ`. Here the work is cut in two
operations, *shrink* (x·Aᵀ, down to the rank) and *expand* (·Bᵀ, added into the output, or into one
part of a fused projection such as q/k/v), and each has two implementations behind one interface:

- `dense`: every adapter's A and B stacked and padded to one rank; every token runs through all
  adapters and a per-token mask keeps its own. Shapes never depend on the mix of adapters in the
  batch, so one compiled graph per bucket serves every mix (HPU graphs, torch.compile, CPU).
- `gather`: each token gathers its own adapter's A and B. Work does not grow with the number of
  adapters, but an index-dependent gather is what graph compilers handle worst (CUDA default).

The scale (lora_alpha / r, or / sqrt(r) for rsLoRA) is folded into B when the weights are packed.
Tokens without an adapter have index -1.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

NO_ADAPTER = -1


class LoraOps(ABC):
    name = ""

    @abstractmethod
    def pack(
        self, a: torch.Tensor, b: list[torch.Tensor]
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """This implementation's layout of a: [adapters, parts, rank, in] and b[part]: [adapters,
        out, rank]."""

    @abstractmethod
    def selector(
        self, index: torch.Tensor, num_adapters: int, rank: int, dtype: torch.dtype
    ) -> torch.Tensor:
        """Per-forward tensor choosing each token's adapter, shared by every layer; index:
        [tokens]."""

    @abstractmethod
    def shrink(self, x: torch.Tensor, a: torch.Tensor, selector: torch.Tensor) -> torch.Tensor:
        """x: [tokens, in] -> [tokens, parts, k]: each part's x·Aᵀ (k: this implementation's
        width)."""

    @abstractmethod
    def expand(
        self, out: torch.Tensor, y: torch.Tensor, b: torch.Tensor, selector: torch.Tensor
    ) -> None:
        """Add y·Bᵀ into out ([tokens, part's out], may be a column slice of a fused output); y:
        [tokens, k]."""


class DenseLora(LoraOps):
    """Stacked adapters: A as one [parts * adapters * rank, in] matrix, B as [adapters * rank, out]
    per part."""

    name = "dense"

    def pack(self, a, b):
        adapters, parts, rank, width = a.shape
        stacked_a = a.permute(1, 0, 2, 3).reshape(parts * adapters * rank, width).contiguous()
        return stacked_a, [
            part.permute(0, 2, 1).reshape(adapters * rank, -1).contiguous() for part in b
        ]

    def selector(self, index, num_adapters, rank, dtype):
        # A comparison, not F.one_hot, which validates its input with a device sync. -1 gives a zero
        # row.
        chosen = (index.unsqueeze(1) == torch.arange(num_adapters, device=index.device)).to(dtype)
        return chosen.repeat_interleave(rank, dim=1)  # [tokens, adapters * rank]

    def shrink(self, x, a, selector):
        y = F.linear(x, a)  # every adapter at once: one GEMM whatever the mix
        return y.view(x.shape[0], -1, selector.shape[1]) * selector.unsqueeze(1)

    def expand(self, out, y, b, selector):
        out += y @ b


class GatherLora(LoraOps):
    """Per-token weights: slot `adapters` is all zeros and serves the tokens without an adapter."""

    name = "gather"
    chunk_tokens = 512  # bounds the gathered [tokens, rank, in] copies of a long prefill

    def pack(self, a, b):
        zero_a = a.new_zeros(1, *a.shape[1:])
        return torch.cat([a, zero_a]), [
            torch.cat([part, part.new_zeros(1, *part.shape[1:])]) for part in b
        ]

    def selector(self, index, num_adapters, rank, dtype):
        return torch.where(index < 0, num_adapters, index)

    def shrink(self, x, a, selector):
        chunks = zip(x.split(self.chunk_tokens), selector.split(self.chunk_tokens))
        return torch.cat([torch.einsum("ti,tpri->tpr", xs, a[ids]) for xs, ids in chunks])

    def expand(self, out, y, b, selector):
        chunks = zip(y.split(self.chunk_tokens), selector.split(self.chunk_tokens))
        out += torch.cat([torch.einsum("tr,tor->to", ys, b[ids]) for ys, ids in chunks])


LORA_IMPLS = {"dense": DenseLora, "gather": GatherLora}


def lora_ops(name: str) -> LoraOps:
    if name not in LORA_IMPLS:
        raise ValueError(
            f"unknown LoRA implementation {name!r} (choose from {', '.join(LORA_IMPLS)})"
        )
    return LORA_IMPLS[name]()


@dataclass(frozen=True)
class LoraSet:
    """The adapters a model serves: their names in slot order, the padded rank, the
    implementation."""

    names: tuple[str, ...]
    rank: int
    ops: LoraOps

    def slot(self, name: str | None) -> int:
        """The slot of an adapter name; None or "" is the base model."""
        return NO_ADAPTER if not name else self.names.index(name)

    def selector(self, index: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        return self.ops.selector(index.reshape(-1), len(self.names), self.rank, dtype)


class LoraWeights(nn.Module):
    """One projection's adapters, in the implementation's layout: one A for all the parts it adapts
    (one shrink GEMM), one B per part, added at that part's columns of the fused output."""

    def __init__(self, ops: LoraOps, a: torch.Tensor, b: list[torch.Tensor], offsets: list[int]):
        super().__init__()
        self.ops, self.offsets = ops, offsets
        packed_a, packed_b = ops.pack(a, b)
        self.register_buffer("a", packed_a)
        for part, tensor in enumerate(packed_b):
            self.register_buffer(f"b{part}", tensor)
        self.sizes = [part.shape[1] for part in b]

    def add_to(self, out: torch.Tensor, x: torch.Tensor, selector: torch.Tensor) -> torch.Tensor:
        """out + this projection's LoRA delta for x (out: the base projection's output)."""
        flat_out = out.view(-1, out.shape[-1])
        y = self.ops.shrink(x.reshape(-1, x.shape[-1]), self.a, selector)
        for part, (offset, size) in enumerate(zip(self.offsets, self.sizes)):
            self.ops.expand(
                flat_out[:, offset : offset + size], y[:, part], getattr(self, f"b{part}"), selector
            )
        return out
