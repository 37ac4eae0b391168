"""Sparse mixture-of-experts block (Mixtral, Qwen3-MoE) in static shapes.

A router picks each token's top-k experts; the block's output is their outputs weighted by the
router's probabilities. The usual implementation loops over the experts that were hit, gathering
their tokens: shapes that change with every batch, which graph devices cannot replay. Both
implementations here have shapes fixed by the bucket alone, like the LoRA ops
(engine/layers/lora.py):

- `dense`: every expert runs over every token, and a routing-weight mask (zero for the experts a
  token did not pick) combines them. num_experts / top_k times the arithmetic, in a few large GEMMs:
  right for graph compilers and for prefill.
- `gather`: each (token, choice) pair gathers its expert's weights and runs alone. Arithmetic
  does not grow with the number of experts, but it reads top_k experts' weights per token: right
  for decode-sized batches on devices that handle gathers well.

Under tensor parallelism every rank holds every expert's slice of the intermediate dimension and
the partial outputs are summed, like a dense MLP's.
"""

from __future__ import annotations

from abc import ABC, abstractmethod

import torch
from torch import nn

from engine.distributed import Parallel, all_reduce_sum
from engine.layers.linear import copy_checked


class MoeOps(ABC):
    name = ""

    @abstractmethod
    def experts(self, x, gate_up, down, weights, ids, act) -> torch.Tensor:
        """x: [tokens, hidden]; gate_up: [experts, 2 * inter, hidden]; down: [experts, hidden,
        inter]; weights, ids: [tokens, top_k]. The weighted sum of each token's chosen experts:
        [tokens, hidden]."""


class DenseMoe(MoeOps):
    name = "dense"

    def experts(self, x, gate_up, down, weights, ids, act):
        gate, up = torch.matmul(x, gate_up.transpose(1, 2)).chunk(
            2, dim=-1
        )  # [experts, tokens, inter] each
        outputs = torch.matmul(act(gate) * up, down.transpose(1, 2))  # [experts, tokens, hidden]
        # A comparison, not F.one_hot, which validates its input with a device sync.
        chosen = ids.unsqueeze(-1) == torch.arange(
            gate_up.shape[0], device=ids.device
        )  # [tokens, k, experts]
        routing = (chosen * weights.unsqueeze(-1)).sum(1)  # [tokens, experts]
        return torch.einsum("eth,te->th", outputs, routing.to(outputs.dtype))


class GatherMoe(MoeOps):
    name = "gather"
    chunk_elements = (
        1 << 26
    )  # bounds the gathered weight copies: pairs per chunk * one expert's weights

    def experts(self, x, gate_up, down, weights, ids, act):
        tokens, top_k = ids.shape
        pairs = x.repeat_interleave(
            top_k, dim=0
        )  # [tokens * k, hidden], token-major like ids.reshape(-1)
        flat_ids = ids.reshape(-1)
        chunk = max(1, self.chunk_elements // gate_up[0].numel())
        outputs = [
            self._run(xs, gate_up[ids_], down[ids_], act)
            for xs, ids_ in zip(pairs.split(chunk), flat_ids.split(chunk))
        ]
        outputs = torch.cat(outputs).view(tokens, top_k, -1)
        return (outputs * weights.unsqueeze(-1).to(outputs.dtype)).sum(1)

    @staticmethod
    def _run(xs, gate_up, down, act):
        gate, up = torch.bmm(gate_up, xs.unsqueeze(-1)).squeeze(-1).chunk(2, dim=-1)
        return torch.bmm(down, (act(gate) * up).unsqueeze(-1)).squeeze(-1)


MOE_IMPLS = {"dense": DenseMoe, "gather": GatherMoe}


def moe_ops(name: str) -> MoeOps:
    if name not in MOE_IMPLS:
        raise ValueError(
            f"unknown MoE implementation {name!r} (choose from {', '.join(MOE_IMPLS)})"
        )
    return MOE_IMPLS[name]()


class SparseMoeBlock(nn.Module):
    """Router + experts. Checkpoint experts load one at a time: part (expert, 'gate'|'up') of
    `gate_up`, part expert of `down`."""

    def __init__(
        self,
        hidden: int,
        intermediate: int,
        num_experts: int,
        top_k: int,
        normalize: bool,
        act,
        parallel: Parallel,
        ops: MoeOps,
    ):
        super().__init__()
        self.hidden, self.intermediate, self.top_k, self.normalize = (
            hidden,
            intermediate,
            top_k,
            normalize,
        )
        self.act, self.parallel, self.ops = act, parallel, ops
        self.local = parallel.split(intermediate, "expert intermediate size")
        self.gate = nn.Linear(
            hidden, num_experts, bias=False
        )  # the router, replicated on every rank
        self.gate_up = nn.Parameter(torch.empty(num_experts, 2 * self.local, hidden))
        self.down = nn.Parameter(torch.empty(num_experts, hidden, self.local))

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        flat = x.reshape(-1, self.hidden)
        probs = torch.softmax(self.gate(flat).float(), dim=-1)
        weights, ids = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        out = self.ops.experts(flat, self.gate_up, self.down, weights.to(x.dtype), ids, self.act)
        return all_reduce_sum(out, self.parallel).view_as(x)

    def checkpoint_parts(self, kind: str) -> set:
        experts = range(self.gate_up.shape[0])
        return (
            {(e, p) for e in experts for p in ("gate", "up")} if kind == "gate_up" else set(experts)
        )

    def load(self, kind: str, part, source, name: str) -> None:
        start = self.parallel.rank * self.local
        rows = slice(start, start + self.local)
        if kind == "down":
            copy_checked(
                self.down[part], source, (slice(None), rows), (self.hidden, self.intermediate), name
            )
            return
        expert, which = part
        dest = (
            self.gate_up[expert, : self.local]
            if which == "gate"
            else self.gate_up[expert, self.local :]
        )
        copy_checked(dest, source, rows, (self.intermediate, self.hidden), name)
