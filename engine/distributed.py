"""Tensor-parallel process group: who we are, and the three collectives the model needs.

With one rank every collective is the identity, so single-device code pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from engine.devices.hooks import mark_step


@dataclass(frozen=True)
class Parallel:
    """The tensor-parallel group: this rank's place in it, and (with pipeline stages) the
    torch.distributed group of its stage's ranks; None: the whole world."""

    rank: int = 0
    world_size: int = 1
    group: object = field(default=None, compare=False)

    def split(self, total: int, what: str) -> int:
        """This rank's share of `total` items that must divide evenly."""
        if total % self.world_size:
            raise ValueError(f"{what} ({total}) cannot be split over {self.world_size} shards")
        return total // self.world_size


SINGLE = Parallel()

# Host values the ranks agree on (free memory, a seed) are CPU tensors, which nccl, hccl and xccl
# refuse: they travel over a gloo group beside the device one, as TGI's process_group_cpu does.
# None: the default group (a gloo one, or a single rank).
_host_group = None


def init_distributed(parallel: Parallel, backend: str, master_addr: str, master_port: int) -> None:
    """Join the shard group (every rank calls this with the same address); `parallel`: this
    rank's place in the whole world (pipeline stages then split it: engine/pipeline/)."""
    if parallel.world_size == 1 or dist.is_initialized():
        return
    global _host_group
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{master_addr}:{master_port}",
        rank=parallel.rank,
        world_size=parallel.world_size,
    )
    if backend != "gloo":
        _host_group = dist.new_group(backend="gloo")  # every rank creates it, in the same order


def all_reduce_sum(x: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    if parallel.world_size > 1:
        # HPU lazy mode: the Habana bridge crashes on an all_reduce inside a lazy graph with
        # PT_HPU_ENABLE_LAZY_COLLECTIVES=1 (which tensor-parallel HPU graphs need) unless the graph
        # is cut first, as vllm-fork (1fd06cc5), vllm-gaudi and TGI do. A no-op elsewhere.
        mark_step()
        dist.all_reduce(x, group=parallel.group)
    return x


def all_gather_last_dim(x: torch.Tensor, parallel: Parallel) -> torch.Tensor:
    """Concatenate every rank's x along the last dimension, in rank order."""
    if parallel.world_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(parallel.world_size)]
    dist.all_gather(parts, x.contiguous(), group=parallel.group)
    return torch.cat(parts, dim=-1)


def min_across_ranks(value: int, parallel: Parallel) -> int:
    """The smallest of every rank's value (free memory: the KV cache must fit on all of them)."""
    if parallel.world_size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=_host_group)
    return int(tensor.item())


def broadcast_int(value: int, parallel: Parallel) -> int:
    """Rank 0's value on every rank."""
    if parallel.world_size == 1:
        return value
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(tensor, src=0, group=_host_group)
    return int(tensor.item())


def gather_objects(value, parallel: Parallel) -> list:
    """Every rank's picklable `value`, in rank order (over the host group)."""
    if parallel.world_size == 1:
        return [value]
    values = [None] * parallel.world_size
    dist.all_gather_object(values, value, group=_host_group)
    return values
