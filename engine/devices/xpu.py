"""Intel GPUs (XPU) on PyTorch's native torch.xpu (PyTorch >= 2.4): no Intel Extension for PyTorch
needed. When IPEX is installed it is imported, which registers its optimised kernels for the
ops the model calls. Eager, or torch.compile per bucket."""
from __future__ import annotations

import importlib
import importlib.util
import logging

import torch

from engine.devices.base import DeviceAdapter
from engine.devices.cpu import CompiledGraphs
from engine.devices.probe import require

log = logging.getLogger(__name__)

ONECCL_BINDINGS = "oneccl_bindings_for_pytorch"
IPEX = "intel_extension_for_pytorch"


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
        self.ipex = optional_module(IPEX)
        log.info("xpu: %s, collectives over %s", "IPEX kernels" if self.ipex else "native torch.xpu", self.dist_backend)

    @property
    def torch_device(self) -> torch.device:
        return torch.device(self.torch_device_type, self.index)

    def memory_info(self) -> tuple[int, int]:
        free, total = torch.xpu.mem_get_info(self.index)
        return int(free), int(total)

    def synchronize(self) -> None:
        torch.xpu.synchronize(self.index)


def distributed_backend() -> str:
    """"ccl" when the oneCCL bindings are installed (importing them registers it), else torch's
    native "xccl"."""
    return "ccl" if optional_module(ONECCL_BINDINGS) is not None else "xccl"


def optional_module(name: str):
    if importlib.util.find_spec(name) is None:
        return None
    return importlib.import_module(name)
