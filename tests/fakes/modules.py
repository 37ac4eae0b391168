"""Installing fake modules where `import` and `importlib.util.find_spec` will find them."""
from __future__ import annotations

import importlib.machinery
import sys
import types


def fake_module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)  # find_spec needs one
    module.__dict__.update(attrs)
    return module


def install(monkeypatch, modules: dict[str, types.ModuleType]) -> None:
    """Put the modules in sys.modules and link each to its parent, as a real import would."""
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
        parent, _, child = name.rpartition(".")
        if parent in modules:
            monkeypatch.setattr(modules[parent], child, module, raising=False)
