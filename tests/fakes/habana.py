"""A fake `habana_frameworks.torch`, as strict as the real bridge where the adapter depends on it.

Mirrors habana_frameworks/torch/hpu/graphs.py of the Habana PyTorch bridge (habana-torch-plugin
1.21/1.22; the wheel's source, read through the search index: it has no public repository to pin a
commit of):
- `wrap_in_hpu_graph(module, asynchronous, disable_tensor_cache, dry_run, max_graphs)` keys graphs by
  the hash of the inputs alone (tensors by shape, Python scalars by value), captures on the first
  call and replays afterwards, returning the very output tensors of the capture every time.
  A replay re-runs the captured ops on the captured tensors (tests/fakes/recording.py): a module
  attribute swapped since the capture (a KV cache) is not seen, as on the device.
  `bypass_hpu_graphs=True` runs the module eagerly; `module.clear_cache()` drops every graph.
- PT_HPU_LAZY_MODE is read once, when the bridge is imported (with `import torch` in current
  releases, through torch's device-backend autoload); unset means eager (the 1.21+ default), and
  `htorch.utils.internal.is_lazy()` answers what was read then.
- `habana_frameworks.torch.distributed.hccl` registers the "hccl" backend when it is imported.
"""

from __future__ import annotations

import os

import torch

from tests.fakes.modules import fake_module, install, install_on_import
from tests.fakes.recording import RecordedOps, recording


def input_hash(value):
    """As graphs.input_hash: tensors by shape (not by dtype or content), everything else by value."""
    if isinstance(value, dict):
        return input_hash(tuple(value.items()))
    if isinstance(value, (tuple, list)):
        return hash(tuple(input_hash(v) for v in value))
    if isinstance(value, torch.Tensor):
        return hash(("tensor", tuple(value.shape)))
    return hash(value)


def copy_to(dst, src) -> None:
    """As graphs.copy_to: the fresh inputs into the captured ones, structure for structure."""
    assert type(dst) is type(src), (
        f"graph input was {type(dst).__name__} at capture, now {type(src).__name__}"
    )
    if isinstance(dst, dict):
        for (dk, dv), (sk, sv) in zip(dst.items(), src.items()):
            assert dk == sk
            copy_to(dv, sv)
    elif isinstance(dst, (list, tuple)):
        for d, s in zip(dst, src):
            copy_to(d, s)
    elif isinstance(dst, torch.Tensor):
        if any(stride == 0 and size > 1 for stride, size in zip(dst.stride(), dst.shape)):
            # An expanded input cannot be copied into; with disable_tensor_cache the real wrapper
            # reads the caller's tensor instead, which this fake can stand in for only when equal.
            assert torch.equal(dst, src), (
                "an expanded graph input changed between capture and replay"
            )
        else:
            dst.copy_(src)


class Captured:
    def __init__(self, inputs, outputs, graph: RecordedOps):
        self.inputs, self.outputs, self.graph = inputs, outputs, graph


class FakeHabana:
    def __init__(
        self, devices: int = 8, memory: tuple[int, int] = (60 << 30, 96 << 30), graph_bytes: int = 0
    ):
        self.devices, self.memory = devices, memory
        self.graph_bytes = graph_bytes  # device memory each captured graph holds (0: free)
        self.lazy: bool | None = None  # PT_HPU_LAZY_MODE as read at import
        self.trace: list = []  # "mark_step" and whatever a test appends, in order
        self.wraps: list = []  # (module, kwargs) of each wrap_in_hpu_graph
        self.caches: list[dict] = []  # each wrapped module's graphs, by input hash
        self.captures: list = []
        self.replays: list = []
        self.bypasses: list = []
        self.hccl_imported = False

    @property
    def graphs(self) -> set:
        return {key for cache in self.caches for key in cache}

    def mark_step(self) -> None:
        self.trace.append("mark_step")

    def wrap_in_hpu_graph(
        self, module, asynchronous=False, disable_tensor_cache=False, dry_run=False, max_graphs=None
    ):
        self.wraps.append((module, dict(disable_tensor_cache=disable_tensor_cache)))
        original, cache = module.forward, {}
        self.caches.append(cache)

        def forward(*args, **kwargs):
            if kwargs.pop("bypass_hpu_graphs", False):
                self.bypasses.append(input_hash((args, kwargs)))
                return original(*args, **kwargs)
            key = input_hash((args, kwargs))
            if key not in cache:
                if max_graphs is not None and len(cache) == max_graphs:
                    return original(*args, **kwargs)
                self._allocate(self.graph_bytes)
                graph = RecordedOps()
                with recording(graph):
                    outputs = original(*args, **kwargs)
                cache[key] = Captured((args, kwargs), outputs, graph)
                self.captures.append(key)
                return outputs
            self.replays.append(key)
            copy_to(cache[key].inputs, (args, kwargs))
            cache[key].graph.replay()
            return cache[key].outputs

        def clear_cache():
            self._release(self.graph_bytes * len(cache))
            cache.clear()

        module.forward, module.clear_cache = forward, clear_cache
        return module

    def _allocate(self, size: int) -> None:
        free, total = self.memory
        if size > free:
            raise RuntimeError(
                f"[Rank:0] FATAL ERROR :: MODULE:PT_DEVMEM Allocation failed for size::{size} "
                f"({free} free): device out of memory"
            )
        self.memory = (free - size, total)

    def _release(self, size: int) -> None:
        free, total = self.memory
        self.memory = (free + size, total)

    def install(self, monkeypatch) -> None:
        """Import time: the lazy mode is read now, from the environment as it is."""
        self.lazy = os.environ.get("PT_HPU_LAZY_MODE", "0") == "1"
        hpu = fake_module(
            "habana_frameworks.torch.hpu",
            wrap_in_hpu_graph=self.wrap_in_hpu_graph,
            synchronize=lambda: None,
            is_available=lambda: self.devices > 0,
            device_count=lambda: self.devices,
            mem_get_info=lambda: self.memory,
        )
        internal = fake_module("habana_frameworks.torch.utils.internal", is_lazy=lambda: self.lazy)
        install(
            monkeypatch,
            {
                "habana_frameworks": fake_module("habana_frameworks"),
                "habana_frameworks.torch": fake_module("habana_frameworks.torch"),
                "habana_frameworks.torch.core": fake_module(
                    "habana_frameworks.torch.core", mark_step=self.mark_step
                ),
                "habana_frameworks.torch.hpu": hpu,
                "habana_frameworks.torch.utils": fake_module("habana_frameworks.torch.utils"),
                "habana_frameworks.torch.utils.internal": internal,
                "habana_frameworks.torch.distributed": fake_module(
                    "habana_frameworks.torch.distributed"
                ),
            },
        )
        install_on_import(
            monkeypatch, "habana_frameworks.torch.distributed.hccl", self._register_hccl
        )
        # Importing the real habana_frameworks.torch registers torch.hpu.
        monkeypatch.setattr(torch, "hpu", hpu, raising=False)

    def _register_hccl(self, module) -> None:
        self.hccl_imported = True
