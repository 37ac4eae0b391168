"""NVIDIA CUDA and AMD ROCm (a ROCm build of torch answers to torch.cuda; torch.version.hip tells).

Graph modes: "graphs" (default) captures a CUDA graph per decode bucket after that bucket's eager
warmup run and replays it every decode step; prefill stays eager (its buckets are few and large,
launch overhead is negligible there). "eager" and "compile" (torch.compile per bucket) as on CPU.
"""

from __future__ import annotations

import logging
import os
import shutil

import torch

from engine.devices.base import DeviceAdapter, kind_of
from engine.devices.cpu.adapter import compile_static
from engine.devices.cuda.graphs import GraphSet
from engine.devices.dynamo import call_compiled
from engine.devices.probe import VISIBILITY_VARS, DeviceError, require

GRAPHED_KINDS = ("decode",)
log = logging.getLogger(__name__)


class CUDAAdapter(DeviceAdapter):
    name = "cuda"
    dist_backend = "nccl"  # RCCL answers to the same name on ROCm
    default_dtype = torch.bfloat16
    default_block_size = 16
    graph_modes = ("graphs", "eager", "compile")
    default_graph_mode = "graphs"
    default_moe_impl = (
        "gather"  # per-token expert weights: arithmetic does not grow with the experts
    )
    default_lora_impl = (
        "gather"  # per-token adapter weights: cost does not grow with the adapters loaded
    )
    torch_device_type = "cuda"
    quantize_modes = ("fp8",)  # FP8 checkpoints through torch._scaled_mm (engine/devices/fp8.py)

    def __init__(self, graph_mode: str | None = None, strict_shapes: bool = True, **options):
        if graph_mode is None and rocm_cannot_capture_collectives(options.get("world_size", 1)):
            log.warning(
                "ROCm %s cannot capture a graph around all_reduce (ROCm/rccl#2022): with more than "
                "one shard the default graph mode is eager",
                torch.version.hip,
            )
            graph_mode = "eager"
        super().__init__(graph_mode, strict_shapes, **options)
        found = require("cuda")
        if self.graph_mode == "compile":
            require_compiler()
        self.rocm = found.rocm
        # One visible device per rank when the launcher narrowed visibility; otherwise rank r takes
        # device r.
        self.index = self.rank % max(1, found.count)
        torch.cuda.set_device(self.index)
        self.graphs = GraphSet(torch.cuda)
        self._compiled: dict = {}

    @property
    def device_type(self) -> str:
        return "rocm" if self.rocm else "cuda"

    @property
    def visibility_var(self) -> str:
        return VISIBILITY_VARS[self.device_type]

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.torch_device_type, self.index)

    def memory_info(self) -> tuple[int, int]:
        free, total = torch.cuda.mem_get_info(self.index)
        return int(free), int(total)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.index)

    def empty_cache(self) -> None:
        """The caching allocator keeps freed blocks reserved, and mem_get_info counts them as
        used."""
        self.synchronize()
        torch.cuda.empty_cache()

    @property
    def captures_graphs(self) -> bool:
        return self.graph_mode == "graphs"

    def prepare_model(self, model, dtype: torch.dtype) -> None:
        from engine.devices.fp8 import fp8_weights, prepare_cuda

        if not fp8_weights(model):
            return
        # ROCm's _scaled_mm wants e4m3fnuz on MI300: FP8 layers dequantize there for now.
        capability = (0, 0) if self.rocm else torch.cuda.get_device_capability(self.index)
        if prepare_cuda(model, self.torch_device, capability):
            self.matmul_kernels = "torch._scaled_mm (fp8 weights)"

    def reset(self) -> None:
        super().reset()
        self.graphs = GraphSet(torch.cuda)  # they point into the previous KV cache

    def forward(self, shape, fn, args, warming):
        kind = kind_of(shape)
        graphed = (
            self.graph_mode == "graphs"
            and kind in GRAPHED_KINDS
            and shape not in self.shapes.without_graph
        )
        if graphed and warming:
            out = fn(
                *args
            )  # the eager run first: lazy initialisation (cuBLAS, allocator) stays out of the graph
            self.synchronize()
            self.graphs.capture(shape, fn, args)
            self.stats[("capture", kind)] += 1
            return out
        if graphed and shape in self.graphs:
            self.stats[("replay", kind)] += 1
            return self.graphs.replay(shape, args)
        if self.graph_mode == "compile" and (warming or shape in self.shapes.warmed):
            return call_compiled(self, shape, self._compile(fn), fn, args, warming)
        self.stats[("eager" if warming or shape in self.shapes.warmed else "bypass", kind)] += 1
        return fn(*args)

    def _compile(self, fn):
        if fn not in self._compiled:
            self._compiled[fn] = compile_static(fn, backend="inductor")
        return self._compiled[fn]


def rocm_cannot_capture_collectives(world_size: int) -> bool:
    """ROCm 7's RCCL fails inside a captured HIP graph (ROCm/rccl#2022)."""
    hip = torch.version.hip
    return world_size > 1 and bool(hip) and int(hip.split(".")[0]) >= 7


def require_compiler() -> None:
    """torch.compile on a GPU builds triton's kernel launchers with the host C compiler, which the
    CUDA "-runtime" images lack: say so at start rather than at the first bucket's compile."""
    candidates = [os.environ.get("CC", ""), "cc", "gcc", "clang"]
    if not any(name and shutil.which(name) for name in candidates):
        raise DeviceError(
            "--graph-mode compile needs a C compiler to build its GPU kernels and none was found "
            "(no $CC, cc, gcc or clang on PATH): use an image with one (Dockerfile_cuda's -devel "
            "base) or --graph-mode graphs"
        )
