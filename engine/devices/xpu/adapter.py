"""Intel GPUs (XPU) on PyTorch's native torch.xpu (torch >= 2.5; several ranks need torch 2.7's
xccl or the oneCCL bindings): no Intel Extension for PyTorch needed. When IPEX is installed it is
imported, which registers its optimised kernels for the ops the model calls. Eager, or
torch.compile per bucket."""

from __future__ import annotations

import importlib
import importlib.util
import logging

import torch

from engine.devices.base import DeviceAdapter
from engine.devices.cpu.adapter import CompiledGraphs
from engine.devices.probe import DeviceError, require

log = logging.getLogger(__name__)

ONECCL_BINDINGS = "oneccl_bindings_for_pytorch"
IPEX = "intel_extension_for_pytorch"
XCCL_SINCE = (2, 7)


class XPUAdapter(CompiledGraphs, DeviceAdapter):
    name = "xpu"
    default_dtype = torch.bfloat16
    default_block_size = 16
    graph_modes = ("eager", "compile")
    torch_device_type = "xpu"

    def __init__(self, graph_mode: str | None = None, strict_shapes: bool = True, **options):
        super().__init__(graph_mode, strict_shapes, **options)
        found = require("xpu")
        self.index = self.rank % max(1, found.count)
        torch.xpu.set_device(self.index)
        self.dist_backend = distributed_backend()
        if self.world_size > 1:
            check_backend(self.dist_backend, torch.__version__)
        self.ipex = optional_module(IPEX)
        log.info(
            "xpu: %s, collectives over %s",
            "IPEX kernels" if self.ipex else "native torch.xpu",
            self.dist_backend,
        )

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.torch_device_type, self.index)

    def memory_info(self) -> tuple[int, int]:
        """Free is what this process has not reserved. torch.xpu.mem_get_info is not used: it exists
        only from torch 2.6, raises on integrated GPUs, and its free figure does not drop with this
        process's own allocations (pytorch#161381), which would size the KV cache past the
        memory."""
        total = int(torch.xpu.get_device_properties(self.index).total_memory)
        return total - int(torch.xpu.memory_reserved(self.index)), total

    def synchronize(self) -> None:
        torch.xpu.synchronize(self.index)

    def empty_cache(self) -> None:
        """memory_info counts what this process reserved: a freed KV cache stays reserved until
        the caching allocator hands it back."""
        self.synchronize()
        torch.xpu.empty_cache()


def distributed_backend() -> str:
    """ "ccl" when the oneCCL bindings are installed (importing them registers it), else torch's
    native "xccl"."""
    return "ccl" if optional_module(ONECCL_BINDINGS) is not None else "xccl"


def check_backend(backend: str, torch_version: str) -> None:
    """torch's own "xccl" backend arrived in torch 2.7; before it, only the oneCCL bindings
    ("ccl")."""
    if backend == "xccl" and version_tuple(torch_version) < XCCL_SINCE:
        raise DeviceError(
            f"--num-shard > 1 on xpu needs collectives: torch {torch_version} has no xccl "
            f"(torch >= 2.7 does); install {ONECCL_BINDINGS} or a newer torch"
        )


def version_tuple(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int(minor)


def optional_module(name: str):
    if importlib.util.find_spec(name) is None:
        return None
    return importlib.import_module(name)
