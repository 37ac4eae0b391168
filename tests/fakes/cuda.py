"""A fake CUDA graph that really records and replays, on CPU.

While capturing, every aten op is recorded with the very tensors it read and wrote. `replay()`
runs the recorded ops again on those same tensors, writing each result into the tensor the op
produced at capture. So, as with a real CUDA graph, a replay computes from whatever the static
input buffers hold now: a caller that forgets to copy fresh inputs in gets stale results.
A host synchronisation during capture (`.item()`) fails, as it does on a GPU.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCS = {torch.ops.aten._local_scalar_dense.default}


class FakeCUDAGraph:
    instances: list["FakeCUDAGraph"] = []

    def __init__(self):
        self.ops: list = []
        self.pool_used = None
        self.replays = 0
        FakeCUDAGraph.instances.append(self)

    def replay(self) -> None:
        self.replays += 1
        for func, args, kwargs, out in self.ops:
            _refresh(out, func(*args, **kwargs))


def _refresh(recorded, fresh) -> None:
    if isinstance(recorded, (tuple, list)):
        for r, f in zip(recorded, fresh):
            _refresh(r, f)
    elif isinstance(recorded, torch.Tensor) and fresh is not recorded and not recorded._is_view():
        recorded.copy_(fresh)  # views alias a refreshed tensor already; in-place ops re-ran in place


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: FakeCUDAGraph):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCS:
            raise RuntimeError("operation not permitted when stream is capturing (a host sync in the graph)")
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.graph.ops.append((func, args, kwargs, out))
        return out


@contextmanager
def fake_graph(graph: FakeCUDAGraph, pool=None):
    graph.pool_used = pool
    with _Recorder(graph):
        yield


def install(monkeypatch, devices: int = 2, hip: str | None = None) -> dict:
    """Make this CPU build of torch look like a CUDA (or, with `hip`, a ROCm) build with `devices` GPUs."""
    calls = {"set_device": [], "pool_handles": 0}

    def pool_handle():
        calls["pool_handles"] += 1
        return ("pool", calls["pool_handles"])

    FakeCUDAGraph.instances.clear()
    monkeypatch.setattr(torch.backends.cuda, "is_built", lambda: True)
    monkeypatch.setattr(torch.version, "hip", hip)
    for name, value in dict(is_available=lambda: True, device_count=lambda: devices,
                            set_device=calls["set_device"].append, synchronize=lambda index=None: None,
                            mem_get_info=lambda index=None: (40 << 30, 80 << 30), CUDAGraph=FakeCUDAGraph,
                            graph=fake_graph, graph_pool_handle=pool_handle).items():
        monkeypatch.setattr(torch.cuda, name, value)
    return calls

