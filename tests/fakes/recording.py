"""Recording and replaying the aten ops of a graph capture, on CPU: what CUDA graphs and HPU graphs do.

While capturing, every aten op is recorded with the very tensors it read and wrote. `replay()` runs
the recorded ops again on those same tensors, writing each result into the tensor the op produced
at capture. As with a real device graph, a replay computes from whatever the captured tensors hold
now: inputs nobody copied fresh values into, and module attributes (a KV cache) swapped since the
capture, give stale results. A host synchronisation during capture (`.item()`) fails, as on a device.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNCS = {torch.ops.aten._local_scalar_dense.default}


class RecordedOps:
    def __init__(self):
        self.ops: list = []
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        for func, args, kwargs, out in self.ops:
            _refresh(out, func(*args, **kwargs))


def _refresh(recorded, fresh) -> None:
    if isinstance(recorded, (tuple, list)):
        for r, f in zip(recorded, fresh):
            _refresh(r, f)
    elif isinstance(recorded, torch.Tensor) and fresh is not recorded and not recorded._is_view():
        recorded.copy_(
            fresh
        )  # views alias a refreshed tensor already; in-place ops re-ran in place


class _Recorder(TorchDispatchMode):
    def __init__(self, graph: RecordedOps):
        super().__init__()
        self.graph = graph

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in SYNCS:
            raise RuntimeError(
                "operation not permitted when stream is capturing (a host sync in the graph)"
            )
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        self.graph.ops.append((func, args, kwargs, out))
        return out


@contextmanager
def recording(graph: RecordedOps):
    with _Recorder(graph):
        yield
