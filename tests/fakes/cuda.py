"""A fake CUDA graph that really records and replays, on CPU (tests/fakes/recording.py), as
torch.cuda.CUDAGraph does (pytorch/pytorch v2.7.1, torch/cuda/graphs.py): a replay computes from
whatever the static input buffers hold now, so a caller that forgets to copy fresh inputs in gets
stale results, and a host synchronisation during capture (`.item()`) fails.

And a fake caching allocator behind `mem_get_info` (pytorch/pytorch v2.7.1,
c10/cuda/CUDACachingAllocator.cpp and torch/cuda/memory.py): a freed tensor's memory stays
reserved by the process for reuse, and cudaMemGetInfo counts reserved memory as used, until
`torch.cuda.empty_cache()` releases the cached blocks that nothing holds. The tensors counted are
those made by torch.zeros and torch.empty (the weights' and the KV cache's allocations; on this CPU
build the "device" tensors live in host memory).
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch

from tests.fakes.recording import RecordedOps, recording


class FakeCUDAGraph(RecordedOps):
    instances: list[FakeCUDAGraph] = []

    def __init__(self):
        super().__init__()
        self.pool_used = None
        FakeCUDAGraph.instances.append(self)


@contextmanager
def fake_graph(graph: FakeCUDAGraph, pool=None):
    graph.pool_used = pool
    with recording(graph):
        yield


class CachingAllocator:
    """Reserved memory grows with the live tensors' high-water mark and shrinks only on
    empty_cache(), to what is still live; free = total - reserved - what other processes use,
    as cudaMemGetInfo reports it."""

    def __init__(self, total: int, elsewhere: int = 0):
        self.total, self.elsewhere, self.allocated, self.reserved = total, elsewhere, 0, 0

    def track(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()  # freed when the last tensor on it goes
        size = storage.nbytes()
        self.allocated += size
        self.reserved = max(self.reserved, self.allocated)
        weakref.finalize(storage, self._free, size)
        return tensor

    def _free(self, size: int) -> None:
        self.allocated -= size

    def empty_cache(self) -> None:
        self.reserved = self.allocated

    def mem_get_info(self, index=None) -> tuple[int, int]:
        return self.total - self.elsewhere - self.reserved, self.total


def _counted(allocate, allocator: CachingAllocator):
    def wrapper(*args, **kwargs):
        return allocator.track(allocate(*args, **kwargs))

    return wrapper


def install(
    monkeypatch,
    devices: int = 2,
    hip: str | None = None,
    memory: int = 80 << 30,
    elsewhere: int = 40 << 30,
) -> dict:
    """Make this CPU build of torch look like a CUDA (or, with `hip`, a ROCm) build with `devices`
    GPUs of `memory` bytes, `elsewhere` of them used by other processes (calls["allocator"] is
    the caching allocator behind mem_get_info)."""
    allocator = CachingAllocator(memory, elsewhere)
    calls = {"set_device": [], "pool_handles": 0, "allocator": allocator}
    monkeypatch.setattr(torch, "zeros", _counted(torch.zeros, allocator))
    monkeypatch.setattr(torch, "empty", _counted(torch.empty, allocator))

    def pool_handle():
        calls["pool_handles"] += 1
        return ("pool", calls["pool_handles"])

    FakeCUDAGraph.instances.clear()
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.version, "hip", hip)
    for name, value in dict(
        is_available=lambda: True,
        device_count=lambda: devices,
        set_device=calls["set_device"].append,
        synchronize=lambda index=None: None,
        mem_get_info=allocator.mem_get_info,
        empty_cache=allocator.empty_cache,
        CUDAGraph=FakeCUDAGraph,
        graph=fake_graph,
        graph_pool_handle=pool_handle,
    ).items():
        monkeypatch.setattr(torch.cuda, name, value)
    return calls
