"""Intel Gaudi (HPU), the first-class target.

Graph modes (the default follows the installed release, engine/devices/hpu/release.py: "compile"
from Habana 1.23 and wherever torch is upstream's, "graphs" on 1.21 and 1.22):
- "graphs": lazy mode with the model wrapped once by `wrap_in_hpu_graph`; every warmed
  bucket is captured during warmup and replayed afterwards, and any other shape bypasses the
  graphs per call (a capture at serving time would stall the batch and grow device memory).
- "lazy": lazy mode without graphs (each forward is traced and its recipe looked up).
- "compile": `torch.compile(backend="hpu_backend")`, one static graph per warmed bucket (eager
bridge). In the lazy modes a step marker cuts the graph after each decoder layer; graph inputs are
checked to be tensors only. The bridge reads PT_HPU_LAZY_MODE once, when torch is imported, so the
launcher puts it in each shard's environment (engine/devices/hpu/env.py); here we only check it.
"""

from __future__ import annotations

import importlib
import os

import torch

from engine.devices.base import DeviceAdapter, kind_of
from engine.devices.cpu.adapter import compile_static
from engine.devices.dynamo import call_compiled
from engine.devices.graph_inputs import check_tensor_inputs
from engine.devices.hpu import attention as hpu_attention
from engine.devices.hpu.env import apply_environment, check_bridge_mode
from engine.devices.hpu.release import installed_stack
from engine.devices.hpu.vars import hpu_environment
from engine.devices.probe import DeviceError, require


class HPUAdapter(DeviceAdapter):
    name = "hpu"
    dist_backend = "hccl"
    default_dtype = torch.bfloat16
    default_block_size = 128  # the matrix engine's preferred tile
    graph_modes = ("graphs", "lazy", "compile")
    default_graph_mode = "graphs"  # 1.21 and 1.22; __init__ asks the installed release
    torch_device_type = "hpu"
    quantize_modes = ("fp8",)  # FP8 checkpoints through fp8_gemm_v2 (engine/devices/fp8.py)

    def __init__(self, graph_mode: str | None = None, strict_shapes: bool = True, **options):
        stack = installed_stack()
        graph_mode = graph_mode or stack.default_graph_mode(os.environ)
        super().__init__(graph_mode, strict_shapes, **options)
        environment = hpu_environment(self.graph_mode, self.world_size, self.cache_dir)

        def before_import():  # the stack is installed: whether it has the mode, then its variables
            problem = stack.mode_problem(self.graph_mode)
            if problem is not None:
                raise DeviceError(problem)
            apply_environment(environment, os.environ)

        self.htorch = load_habana(before_import)
        self.lazy = self.graph_mode != "compile"
        check_bridge_mode(self.htorch, self.lazy, self.graph_mode)
        if self.world_size > 1:
            # Registers the "hccl" backend with torch.distributed; init_process_group needs it
            # first.
            importlib.import_module("habana_frameworks.torch.distributed.hccl")
        if self.lazy:
            self.step_marker = self.htorch.core.mark_step
        self.kernels = hpu_attention.load_kernels()
        self.attention_backend = self.kernels.backend
        self._graphed: dict = {}  # model -> the same model, its forward wrapped in HPU graphs

    @property
    def captures_graphs(self) -> bool:
        return self.graph_mode == "graphs"

    def prepare_transformers(self, causal_lm_class):
        from engine.devices.hpu.optimum import adapt_for_fallback

        return adapt_for_fallback(causal_lm_class)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.torch_device_type)

    def prepare_model(self, model, dtype: torch.dtype) -> None:
        from engine.devices.fp8 import fp8_weights, prepare_hpu

        if fp8_weights(model):
            prepare_hpu(model, self.torch_device, gaudi2=self.hardware() == "gaudi2")
            self.matmul_kernels = "torch.ops.hpu.fp8_gemm_v2 (fp8 weights)"

    def hardware(self) -> str:
        """ "gaudi2", "gaudi3" or "gaudi" (as vllm-hpu-extension's environment.get_hw asks)."""
        import habana_frameworks.torch.utils.experimental as htexp

        kinds = htexp.synDeviceType
        return {kinds.synDeviceGaudi2: "gaudi2", kinds.synDeviceGaudi3: "gaudi3"}.get(
            htexp._get_device_type(), "gaudi"
        )

    def memory_info(self) -> tuple[int, int]:
        free, total = torch.hpu.mem_get_info()
        return int(free), int(total)

    def synchronize(self) -> None:
        self.htorch.hpu.synchronize()

    def reset(self) -> None:
        """A new KV cache: the wrapper keys graphs by input shapes alone, so a graph captured on the
        old cache would be replayed on the new one's shapes, reading and writing freed memory."""
        super().reset()
        for model in self._graphed.values():
            if hasattr(model, "clear_cache"):
                model.clear_cache()

    def forward(self, shape, fn, args, warming):
        check_tensor_inputs(args)
        self.kernels.configure(fn)
        graphed = (
            warming or shape in self.shapes.warmed
        ) and shape not in self.shapes.without_graph
        self.mark_step()  # the inputs' host-to-device copies stay out of the model's graph
        if self.graph_mode == "graphs":
            self.stats[
                (("capture" if warming else "replay") if graphed else "bypass", kind_of(shape))
            ] += 1
            out = self._wrapped(fn)(*args, bypass_hpu_graphs=not graphed)
            if graphed:
                # A graph returns the same static output tensor every time: the next replay of this
                # bucket (a batch split in two groups) would overwrite what the caller still holds.
                out = tuple(t.clone() for t in out) if isinstance(out, tuple) else out.clone()
        elif self.graph_mode == "compile" and graphed:
            self.stats[("compiled", kind_of(shape))] += 1
            out = call_compiled(self, shape, self._compiled(fn), fn, args, warming)
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
            self._graphed[model] = self.htorch.hpu.wrap_in_hpu_graph(
                model, disable_tensor_cache=True
            )
        return self._graphed[model]

    def _compiled(self, model):
        if model not in self._graphed:
            self._graphed[model] = compile_static(model, backend="hpu_backend")
        return self._graphed[model]


def load_habana(before_import):
    """habana_frameworks.torch, after checking that a Gaudi device is visible (DeviceError if
    not)."""
    require("hpu", before_import)
    import habana_frameworks.torch as htorch
    import habana_frameworks.torch.core  # noqa: F401 - mark_step
    import habana_frameworks.torch.hpu  # noqa: F401 - graphs, synchronize
    import habana_frameworks.torch.utils.internal  # noqa: F401 - is_lazy

    return htorch
