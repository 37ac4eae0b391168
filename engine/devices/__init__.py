"""Device adapters, imported lazily so that asking for one never imports another vendor's stack."""
import importlib

from engine.devices.base import DeviceAdapter

_ADAPTERS = {
    "cpu": ("engine.devices.cpu", "CPUAdapter"),
}


def available_devices() -> list[str]:
    return sorted(_ADAPTERS)


def get_adapter(name: str, graph_mode: str = "eager", strict_shapes: bool = True) -> DeviceAdapter:
    if name not in _ADAPTERS:
        raise ValueError(f"unknown device {name!r} (available: {', '.join(available_devices())})")
    module, cls = _ADAPTERS[name]
    return getattr(importlib.import_module(module), cls)(graph_mode=graph_mode, strict_shapes=strict_shapes)
