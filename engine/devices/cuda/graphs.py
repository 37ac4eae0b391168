"""CUDA graphs, one per bucket: static input buffers, one shared memory pool, replay by copying.

A captured graph replays the exact kernels it recorded on the exact buffers it recorded, so each
bucket keeps its own input tensors (the ones warmup captured with) and every step copies its
inputs into them before replaying. All graphs draw from one memory pool: captured largest bucket
first, the smaller ones reuse its memory instead of each holding their own.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass

import torch

from engine.devices.graph_inputs import check_tensor_inputs, copy_into


@dataclass
class Captured:
    graph: object  # torch.cuda.CUDAGraph
    inputs: tuple  # the static buffers the graph reads
    output: torch.Tensor  # the static buffer the graph writes


class GraphSet:
    def __init__(self, cuda):
        self.cuda = cuda  # torch.cuda (a fake in tests)
        self.pool = None
        self.captured: dict[Hashable, Captured] = {}

    def __contains__(self, key: Hashable) -> bool:
        return key in self.captured

    def capture(self, key: Hashable, fn: Callable, inputs: tuple) -> None:
        """Record `fn(*inputs)`; `inputs` become the graph's static buffers (the caller lets go of
        them)."""
        check_tensor_inputs(inputs)
        if self.pool is None:
            self.pool = self.cuda.graph_pool_handle()
        graph = self.cuda.CUDAGraph()
        with self.cuda.graph(graph, pool=self.pool):
            output = fn(*inputs)
        self.captured[key] = Captured(graph, inputs, output)

    def replay(self, key: Hashable, inputs: tuple) -> torch.Tensor:
        captured = self.captured[key]
        copy_into(captured.inputs, inputs)
        captured.graph.replay()
        # The next replay overwrites the static output, and a caller may still hold this one
        # (a batch split over two runs of the same bucket).
        return captured.output.clone()
