"""Installing fake modules where `import` and `importlib.util.find_spec` will find them."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import types
from collections.abc import Callable


def fake_module(name: str, **attrs) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)  # find_spec needs one
    module.__path__ = []  # a package: its submodules can be imported (install_on_import)
    module.__dict__.update(attrs)
    return module


def install(monkeypatch, modules: dict[str, types.ModuleType]) -> None:
    """Put the modules in sys.modules and link each to its parent, as a real import would."""
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
        parent, _, child = name.rpartition(".")
        if parent in modules:
            monkeypatch.setattr(modules[parent], child, module, raising=False)


class _OnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """A module that only comes to be when it is imported, running `body` then: so a fake can
    notice the import itself (a backend registered by it) or fail it (a missing dependency)."""

    def __init__(self, name: str, body: Callable[[types.ModuleType], None]):
        self.name, self.body = name, body

    def find_spec(self, fullname, path=None, target=None):
        return importlib.machinery.ModuleSpec(fullname, self) if fullname == self.name else None

    def create_module(self, spec):
        return None

    def exec_module(self, module) -> None:
        self.body(module)
        parent, _, child = self.name.rpartition(".")
        if parent in sys.modules:
            setattr(sys.modules[parent], child, module)


def install_on_import(monkeypatch, name: str, body: Callable[[types.ModuleType], None]) -> None:
    """`import name` runs body(module) (which may raise, as a failing import does)."""
    monkeypatch.setitem(
        sys.modules, name, None
    )  # so that undoing leaves it absent, even once imported
    monkeypatch.delitem(sys.modules, name)
    monkeypatch.setattr(sys, "meta_path", [_OnImport(name, body), *sys.meta_path])
