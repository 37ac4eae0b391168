"""A fake `habana_frameworks.torch`: it runs everything eagerly on CPU and records what was asked of
it: model wraps, graph captures and replays by input hash (hashed as the real graph cache does,
Python scalars by value), per-call bypasses, and mark_step calls in one shared trace."""
from __future__ import annotations

import torch

from tests.fakes.modules import fake_module, install


def input_hash(value):
    """Tensors by shape and dtype, Python scalars by value: why a scalar input means a graph per value."""
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, (tuple, list)):
        return tuple(input_hash(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, input_hash(v)) for k, v in sorted(value.items()))
    return ("scalar", value)


class FakeHabana:
    def __init__(self, devices: int = 8, memory: tuple[int, int] = (60 << 30, 96 << 30)):
        self.devices, self.memory = devices, memory
        self.trace: list = []           # "mark_step" and whatever a test appends, in order
        self.wraps: list = []           # (module, kwargs) of each wrap_in_hpu_graph
        self.graphs: set = set()        # input hashes with a captured graph
        self.captures: list = []
        self.replays: list = []
        self.bypasses: list = []

    def mark_step(self) -> None:
        self.trace.append("mark_step")

    def wrap_in_hpu_graph(self, module, **kwargs):
        self.wraps.append((module, kwargs))
        original = module.forward

        def forward(*args, bypass_hpu_graphs=False, **kw):
            key = input_hash((args, kw))
            if bypass_hpu_graphs:
                self.bypasses.append(key)
            elif key in self.graphs:
                self.replays.append(key)
            else:
                self.graphs.add(key)
                self.captures.append(key)
            return original(*args, **kw)

        module.forward = forward
        return module

    def install(self, monkeypatch) -> None:
        hpu = fake_module("habana_frameworks.torch.hpu", wrap_in_hpu_graph=self.wrap_in_hpu_graph,
                          synchronize=lambda: None, is_available=lambda: self.devices > 0,
                          device_count=lambda: self.devices, mem_get_info=lambda: self.memory)
        install(monkeypatch, {
            "habana_frameworks": fake_module("habana_frameworks"),
            "habana_frameworks.torch": fake_module("habana_frameworks.torch"),
            "habana_frameworks.torch.core": fake_module("habana_frameworks.torch.core", mark_step=self.mark_step),
            "habana_frameworks.torch.hpu": hpu,
        })
        # Importing the real habana_frameworks.torch registers torch.hpu.
        monkeypatch.setattr(torch, "hpu", hpu, raising=False)
