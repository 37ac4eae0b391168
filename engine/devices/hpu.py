"""Intel Gaudi (HPU), the first-class target.

Graph modes:
- "graphs" (default): lazy mode with the model wrapped once by `wrap_in_hpu_graph`; every warmed
  bucket is captured during warmup and replayed afterwards, and any other shape bypasses the
  graphs per call (a capture at serving time would stall the batch and grow device memory).
- "lazy": lazy mode without graphs (each forward is traced and its recipe looked up).
- "compile": `torch.compile(backend="hpu_backend")`, one static graph per warmed bucket.
In the lazy modes a step marker cuts the graph after each decoder layer and before every
collective; graph inputs are checked to be tensors only.
"""
from __future__ import annotations

import os

import torch

from engine.devices import hpu_attention
from engine.devices.base import DeviceAdapter, kind_of
from engine.devices.cpu import compile_static
from engine.devices.graph_inputs import check_tensor_inputs
from engine.devices.hpu_env import apply_environment, hpu_environment
from engine.devices.probe import require


class HPUAdapter(DeviceAdapter):
    name = "hpu"
    dist_backend = "hccl"
    default_dtype = torch.bfloat16
    default_block_size = 128  # the matrix engine's preferred tile
    graph_modes = ("graphs", "lazy", "compile")
    default_graph_mode = "graphs"
    torch_device_type = "hpu"

    def __init__(self, graph_mode: str | None = None, strict_shapes: bool = True, **options):
        super().__init__(graph_mode, strict_shapes, **options)
        environment = hpu_environment(self.graph_mode, self.world_size, self.cache_dir)
        self.htorch = load_habana(lambda: apply_environment(environment, os.environ))
        self.lazy = self.graph_mode != "compile"
        if self.lazy:
            self.step_marker = self.htorch.core.mark_step
        self.attention_backend = hpu_attention.load_backend()
        self._graphed: dict = {}  # model -> the same model, its forward wrapped in HPU graphs

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.torch_device_type)

    def memory_info(self) -> tuple[int, int]:
        free, total = torch.hpu.mem_get_info()
        return int(free), int(total)

    def synchronize(self) -> None:
        self.htorch.hpu.synchronize()

    def forward(self, shape, fn, args, warming):
        check_tensor_inputs(args)
        graphed = warming or shape in self.shapes.warmed
        self.mark_step()  # the inputs' host-to-device copies stay out of the model's graph
        if self.graph_mode == "graphs":
            self.stats[(("capture" if warming else "replay") if graphed else "bypass", kind_of(shape))] += 1
            out = self._wrapped(fn)(*args, bypass_hpu_graphs=not graphed)
        elif self.graph_mode == "compile" and graphed:
            self.stats[("compiled", kind_of(shape))] += 1
            out = self._compiled(fn)(*args)
        else:
            self.stats[("bypass" if not graphed else "lazy", kind_of(shape))] += 1
            out = fn(*args)
        self.mark_step()
        return out

    def mark_step(self) -> None:
        if self.step_marker is not None:
            self.step_marker()

    def _wrapped(self, model):
        if model not in self._graphed:
            # disable_tensor_cache: intermediate tensors are not kept alive between replays,
            # which leaves the memory to the KV cache.
            self._graphed[model] = self.htorch.hpu.wrap_in_hpu_graph(model, disable_tensor_cache=True)
        return self._graphed[model]

    def _compiled(self, model):
        if model not in self._graphed:
            self._graphed[model] = compile_static(model, backend="hpu_backend")
        return self._graphed[model]


def load_habana(before_import):
    """habana_frameworks.torch, after checking that a Gaudi device is visible (DeviceError if not)."""
    require("hpu", before_import)
    import habana_frameworks.torch as htorch
    import habana_frameworks.torch.core  # noqa: F401 - mark_step
    import habana_frameworks.torch.hpu  # noqa: F401 - graphs, synchronize

    return htorch
