"""A fake CUDA graph that really records and replays, on CPU (tests/fakes/recording.py), as
torch.cuda.CUDAGraph does (pytorch/pytorch v2.7.1, torch/cuda/graphs.py): a replay computes from
whatever the static input buffers hold now, so a caller that forgets to copy fresh inputs in gets
stale results, and a host synchronisation during capture (`.item()`) fails.
"""

from __future__ import annotations

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


def install(monkeypatch, devices: int = 2, hip: str | None = None) -> dict:
    """Make this CPU build of torch look like a CUDA (or, with `hip`, a ROCm) build with `devices` GPUs."""
    calls = {"set_device": [], "pool_handles": 0}

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
        mem_get_info=lambda index=None: (40 << 30, 80 << 30),
        CUDAGraph=FakeCUDAGraph,
        graph=fake_graph,
        graph_pool_handle=pool_handle,
    ).items():
        monkeypatch.setattr(torch.cuda, name, value)
    return calls
