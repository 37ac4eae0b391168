"""What the bucket scheduler needs from a device, and the registry of warmed shapes."""

from __future__ import annotations

import gc
import os
from abc import ABC, abstractmethod
from collections import Counter
from collections.abc import Callable, Hashable
from contextlib import ExitStack, contextmanager, nullcontext
from pathlib import Path

import torch

from engine.attention.backend import AttentionBackend, use_backend
from engine.devices.hooks import step_markers
from engine.errors import UnwarmedShapeError


class ShapeRegistry:
    """Shapes warmup has run. In strict mode a forward at any other shape raises."""

    def __init__(self, strict: bool):
        self.strict = strict
        self.warmed: set[Hashable] = set()
        self.without_graph: set[Hashable] = (
            set()
        )  # warmed, but run without a graph (graph memory budget)
        self.unwarmed: Counter = Counter()  # shape -> forwards run at it without warmup

    def mark_warmed(self, shape: Hashable, graph: bool = True) -> None:
        self.warmed.add(shape)
        if not graph:
            self.without_graph.add(shape)

    def clear(self) -> None:
        self.warmed.clear()
        self.without_graph.clear()

    def check(self, shape: Hashable) -> None:
        if shape in self.warmed:
            return
        self.unwarmed[shape] += 1
        if self.strict:
            raise UnwarmedShapeError(f"forward at shape {shape} that warmup did not run")


class DeviceAdapter(ABC):
    name: str = ""
    dist_backend: str = ""
    default_dtype: torch.dtype = torch.float32
    default_block_size: int = 16
    graph_modes: tuple[str, ...] = ("eager",)
    default_graph_mode: str = "eager"
    default_lora_impl: str = (
        "dense"  # engine/layers/lora.py: static shapes, safe in graphs and buckets
    )
    default_moe_impl: str = (
        "dense"  # engine/layers/moe.py: every expert over every token, graph-friendly
    )
    quantize_modes: tuple[
        str, ...
    ] = ()  # --quantize modes besides none (engine/weights/quantize.py)
    step_marker: Callable[[], None] | None = None  # installed around forwards (HPU lazy mode)
    attention_backend: AttentionBackend | None = None  # None: pure torch attention
    matmul_kernels: str = "torch"  # what multiplies the weights, once prepare_model has run
    graph_budget = (
        None  # engine.warmup.budget.GraphBudget, set by the shard when graphs are captured
    )
    own_memory: bool = (
        True  # memory_info() is this device's, so warmup's memory figures are this shard's
    )

    def __init__(
        self,
        graph_mode: str | None = None,
        strict_shapes: bool = True,
        *,
        rank: int = 0,
        world_size: int = 1,
        cache_dir: Path | None = None,
    ):
        graph_mode = graph_mode or self.default_graph_mode
        if graph_mode not in self.graph_modes:
            raise ValueError(
                f"graph mode {graph_mode!r} is not available on {self.name} (choose from "
                f"{', '.join(self.graph_modes)})"
            )
        self.graph_mode = graph_mode
        self.rank, self.world_size, self.cache_dir = rank, world_size, cache_dir
        if graph_mode == "compile" and cache_dir is not None:
            # inductor's FX graph and AOT autograd caches under ours (a user's setting wins): a
            # second start loads the kernels the first one compiled
            os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(Path(cache_dir) / "inductor"))
        self.shapes = ShapeRegistry(strict_shapes)
        self.stats: Counter = Counter()  # "replay", "capture", "bypass", ... per kind of shape
        self._profiling = False

    def kernel_names(self) -> str:
        """The kernels in use beyond pure torch, in words ("" where everything is pure torch):
        Info's attention_impl (and so the router's /info) names them."""
        parts = []
        if self.attention_backend is not None:
            parts.append(f"attention: {self.attention_backend.name}")
        if self.matmul_kernels != "torch":
            parts.append(f"matmul: {self.matmul_kernels}")
        return "; ".join(parts)

    def serving_path(self) -> str:
        """kernel_names, or "pure torch": the line said once at start."""
        return self.kernel_names() or "pure torch"

    def auto_dtype(self) -> tuple[torch.dtype, str]:
        """--dtype auto: the dtype this device serves best, and why (said at start)."""
        return self.default_dtype, f"the {self.name} default"

    @property
    def device_type(self) -> str:
        """The device as Info.device_type reports it (ROCm reports "rocm", not torch's "cuda")."""
        return self.name

    @property
    @abstractmethod
    def torch_device(self) -> torch.device: ...

    def zeros(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """A zero-filled tensor on this device (the KV cache is made of these)."""
        return torch.zeros(shape, dtype=dtype, device=self.torch_device)

    @abstractmethod
    def memory_info(self) -> tuple[int, int]:
        """(free, total) bytes of the memory the KV cache lives in."""

    def synchronize(self) -> None:
        """Wait for queued device work (no-op where execution is synchronous)."""

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host tensor copied to this device (the runner's inputs)."""
        return tensor.to(self.torch_device, non_blocking=True)

    def device_scope(self):
        """Entered around each shard step (the lazy-graph simulator tracks device ops in it)."""
        return nullcontext()

    @property
    def captures_graphs(self) -> bool:
        """Whether warmup keeps a device graph per bucket (memory the KV cache must leave free)."""
        return False

    @property
    def warm_runs_forward(self) -> bool:
        """Whether warming a bucket must run its forward: yes wherever a graph is compiled or
        captured. Where nothing is (CPU eager), warmup registers the bucket's shape without running
        it, so start-up takes seconds and strict mode still refuses any other shape."""
        return True

    def prepare_transformers(self, causal_lm_class):
        """The class the transformers fallback builds for `causal_lm_class`: a device may adapt
        transformers first (HPU: optimum-habana, engine/devices/hpu/optimum.py). Elsewhere the class
        itself."""
        return causal_lm_class

    def prepare_model(self, model, dtype: torch.dtype) -> None:
        """Put a loaded model's weights in the form this device multiplies fastest (CPU: packed
        bfloat16, engine/devices/cpu/packed.py). Elsewhere they stay as loaded."""

    def prepare_draft(self, model, dtype: torch.dtype) -> None:
        """prepare_model for a draft model, whose kernels may trade exactness for speed: the
        target checks every token it proposes. Elsewhere the same as prepare_model."""
        self.prepare_model(model, dtype)

    def reset(self) -> None:
        """Forget the warmed shapes (and graphs): a new KV cache was bound, so they must be warmed
        again."""
        self.shapes.clear()

    def release_memory(self, model) -> None:
        """Before a new KV cache is sized (a second Warmup): nothing may still hold the old one, or
        the new one is sized from memory the old one still takes. The model lets go of it, the
        graphs captured on it are dropped, and the allocator hands back what it had cached."""
        layers = len(getattr(model, "layers", ())) or model.config.num_layers
        model.bind_kv_cache([None] * layers)
        self.reset()
        gc.collect()
        self.empty_cache()

    def empty_cache(self) -> None:
        """Return the memory the device allocator caches for reuse (CUDA, XPU); a no-op here."""

    @contextmanager
    def profiling(self):
        """Warm runs inside run eagerly and leave nothing behind: no graph, no shape marked warm
        (the memory-profiling run, on a scratch cache that is freed right after)."""
        self._profiling = True
        try:
            yield
        finally:
            self._profiling = False

    def warm(self, shape: Hashable, fn: Callable, *args, graph: bool = True):
        """Run `fn` once at `shape` during warmup (capturing or compiling a graph where the device
        does; with graph=False the shape is warmed to run without one)."""
        if not (self._profiling or self.warm_runs_forward):
            self.shapes.mark_warmed(shape, graph)
            return None
        with self._hooks():
            if self._profiling:
                return self.forward(shape, fn, args, warming=False)
            if not graph:
                self.shapes.without_graph.add(shape)
            out = self.forward(shape, fn, args, warming=True)
        self.synchronize()
        self.shapes.mark_warmed(shape, graph)
        return out

    def run(self, shape: Hashable, fn: Callable, *args):
        """Run `fn` at a bucket shape; strict mode refuses a shape warmup never saw."""
        self.shapes.check(shape)
        with self._hooks():
            return self.forward(shape, fn, args, warming=False)

    def _hooks(self):
        stack = ExitStack()
        stack.enter_context(step_markers(self.step_marker))
        stack.enter_context(use_backend(self.attention_backend))
        return stack

    def forward(self, shape: Hashable, fn: Callable, args: tuple, warming: bool):
        """One forward. A shape warmup never ran (lenient mode) runs eagerly: compiling or
        capturing at serving time would stall every request in the batch."""
        if (warming or shape in self.shapes.warmed) and shape not in self.shapes.without_graph:
            return self.graph_for(shape, fn)(*args)
        self.stats[("bypass", kind_of(shape))] += 1
        return fn(*args)

    def graph_for(self, shape: Hashable, fn: Callable) -> Callable:
        """The callable to run at `shape`; eager by default."""
        return fn


def kind_of(shape: Hashable) -> str:
    """ "prefill", "decode", ... : the runner's shape keys are (kind, bucket)."""
    return (
        shape[0] if isinstance(shape, tuple) and shape and isinstance(shape[0], str) else "forward"
    )
