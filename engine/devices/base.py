"""What the bucket scheduler needs from a device, and the registry of warmed shapes."""
from __future__ import annotations

from abc import ABC, abstractmethod
from collections import Counter
from typing import Callable, Hashable

import torch

from engine.errors import UnwarmedShapeError


class ShapeRegistry:
    """Shapes warmup has run. In strict mode a forward at any other shape raises."""

    def __init__(self, strict: bool):
        self.strict = strict
        self.warmed: set[Hashable] = set()
        self.unwarmed: Counter = Counter()  # shape -> forwards run at it without warmup

    def mark_warmed(self, shape: Hashable) -> None:
        self.warmed.add(shape)

    def check(self, shape: Hashable) -> None:
        if shape in self.warmed:
            return
        self.unwarmed[shape] += 1
        if self.strict:
            raise UnwarmedShapeError(f"forward at shape {shape} that warmup did not run")


class DeviceAdapter(ABC):
    name: str = ""
    dist_backend: str = ""
    default_dtype: torch.dtype = torch.float32
    default_block_size: int = 16
    graph_modes: tuple[str, ...] = ("eager",)

    def __init__(self, graph_mode: str = "eager", strict_shapes: bool = True):
        if graph_mode not in self.graph_modes:
            raise ValueError(f"graph mode {graph_mode!r} is not available on {self.name} (choose from {', '.join(self.graph_modes)})")
        self.graph_mode = graph_mode
        self.shapes = ShapeRegistry(strict_shapes)

    @property
    @abstractmethod
    def torch_device(self) -> torch.device: ...

    @abstractmethod
    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the memory the KV cache lives in."""

    def synchronize(self) -> None:
        """Wait for queued device work (no-op where execution is synchronous)."""

    def warm(self, shape: Hashable, fn: Callable, *args):
        """Run `fn` once at `shape` during warmup (capturing or compiling a graph where the device does)."""
        out = self.graph_for(shape, fn)(*args)
        self.synchronize()
        self.shapes.mark_warmed(shape)
        return out

    def run(self, shape: Hashable, fn: Callable, *args):
        """Run `fn` at a bucket shape; strict mode refuses a shape warmup never saw."""
        self.shapes.check(shape)
        return self.graph_for(shape, fn)(*args)

    def graph_for(self, shape: Hashable, fn: Callable) -> Callable:
        """The callable to run at `shape`; eager by default."""
        return fn
