"""Device adapters (HPU, CUDA/ROCm, XPU, CPU) and the device probes: the only place vendor libraries
are imported, lazily, so that asking for one device never imports another vendor's stack. Imports
engine.attention (kernels it replaces), engine.errors and its own modules."""

from __future__ import annotations

import importlib
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # torch is imported with the adapter, not by the launcher's device checks
    from engine.devices.base import DeviceAdapter

_ADAPTERS = {
    "cpu": ("engine.devices.cpu.adapter", "CPUAdapter"),
    "cuda": ("engine.devices.cuda.adapter", "CUDAAdapter"),
    "hpu": ("engine.devices.hpu.adapter", "HPUAdapter"),
    "xpu": ("engine.devices.xpu.adapter", "XPUAdapter"),
}


def available_devices() -> list[str]:
    return sorted(_ADAPTERS)


def choose_device(requested: str, world_size: int = 1, probe=None) -> str:
    """The concrete device for `requested`: "auto" takes hpu > cuda/rocm > xpu > cpu, whichever is
    present and usable; a named device is returned as is (its adapter checks it at start)."""
    if requested != "auto":
        return requested
    from engine.devices import probe as probes

    return probes.resolve_device(
        "auto", world_size, os.environ, available_devices, probe=probe or probes.probe_devices
    ).name


def get_adapter(
    name: str, graph_mode: str | None = None, strict_shapes: bool = True, **options
) -> DeviceAdapter:
    """The adapter for device `name` (or "auto"). `options`: rank, world_size, cache_dir, simulate
    (a device simulated on the CPU: engine/devices/simulate/). A device whose library or hardware
    is missing raises DeviceError naming what is missing."""
    simulate = options.pop("simulate", None)
    name = choose_device(name, options.get("world_size", 1))
    if simulate:
        from engine.devices.simulate.adapter import simulated_adapter

        return simulated_adapter(simulate, name, graph_mode, strict_shapes, **options)
    if name not in _ADAPTERS:
        raise ValueError(f"unknown device {name!r} (available: {', '.join(available_devices())})")
    module, cls = _ADAPTERS[name]
    return getattr(importlib.import_module(module), cls)(
        graph_mode=graph_mode, strict_shapes=strict_shapes, **options
    )
