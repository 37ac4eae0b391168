"""Gaudi's lazy mode, simulated on CPU tensors.

Lazy mode records every op on a device tensor and runs the recorded graph at `mark_step()`. The
graph is compiled once per key (its ops, their shapes, dtypes and scalar arguments) and cached, so a
new key at serving time is a compile that stalls the batch. A host read of a device tensor whose
graph is still pending (`.item()`, `.tolist()`, `.cpu()`, `bool(t)`) or an op whose output shape
depends on the data (`nonzero`, a boolean index) runs the pending graph there: a graph break. Gaudi
has no float64: an op that makes one is refused.

Device tensors are the ones the adapter put on the device (inputs, weights, the KV cache), the
outputs of ops that read one, and everything made inside a forward. Host-side metadata building
touches none of them, so it is not a device op. View ops add nothing to a key (lazy mode folds them
into the op that reads them, whose key holds the view's shape).
"""

from __future__ import annotations

import threading
import traceback
from collections import Counter
from contextlib import contextmanager

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from engine.errors import BucketserveError, UnwarmedShapeError

_ON_DEVICE = "_bucketserve_on_device"
# Tensor methods that copy a device tensor's data to the host.
HOST_READS = frozenset(
    {"tolist", "item", "numpy", "cpu", "__bool__", "__int__", "__float__", "__index__", "__array__"}
)
# Ops whose output shape depends on the values of their input.
DATA_DEPENDENT = frozenset(
    {
        "nonzero",
        "nonzero_static",
        "masked_select",
        "unique",
        "_unique",
        "_unique2",
        "unique_consecutive",
        "unique_dim",
        "argwhere",
    }
)
# Overloads whose output shape depends on a tensor argument's values (repeat_interleave with a
# Python int of repeats has a static shape).
DATA_DEPENDENT_OVERLOADS = frozenset(
    {"aten.repeat_interleave.Tensor", "aten.repeat_interleave.self_Tensor"}
)
PHASES = ("warmup", "serving")


class Float64Error(BucketserveError):
    """An op made a float64 tensor on the device, which Gaudi (and Intel Arc) cannot hold."""


def on_device(tensor: torch.Tensor) -> torch.Tensor:
    """Mark `tensor` as one the adapter put on the device; returns it."""
    setattr(tensor, _ON_DEVICE, True)
    return tensor


def is_on_device(value) -> bool:
    return isinstance(value, torch.Tensor) and getattr(value, _ON_DEVICE, False)


def caller() -> str:
    """The innermost frame outside torch and this package: who asked for the op."""
    for frame in reversed(traceback.extract_stack()[:-1]):
        if "/torch/" not in frame.filename and "/devices/simulate/" not in frame.filename:
            return f"{frame.filename}:{frame.lineno} in {frame.name}"
    return "unknown"


class LazyGraphs:
    """The graph cache and its counters: compiles and breaks per phase. Strict (the default): after
    warmup, a graph not seen before raises UnwarmedShapeError instead of compiling."""

    def __init__(self, strict: bool = True):
        self.strict = strict
        self.serving = False  # the shard's phase; warmup runs (adapter.warm) count as warmup always
        self.compiles: Counter = Counter()  # phase -> new graphs
        self.breaks: Counter = Counter()  # phase -> graphs cut by a host read or a dynamic shape
        self.events: list[dict] = []  # every compile and break, with what caused it (check-shapes)
        self.cache: set[tuple] = set()
        self.known_ops: set[tuple] = set()  # every op key of a compiled graph
        self._local = threading.local()
        self._dispatch, self._function = _Recorder(self), _HostReads(self)

    # --- the per-thread state: the pending graph, the scopes entered ---------------------------

    @property
    def _state(self):
        state = self._local
        if not hasattr(state, "pending"):
            state.pending, state.depth, state.forward, state.warming = [], 0, 0, 0
            state.reading = False  # inside a host read: its own copies are not graph ops
            state.new_ops = []  # (op key, caller) of ops never compiled before, in serving
        return state

    def phase(self) -> str:
        return "serving" if self.serving and not self._state.warming else "warmup"

    @contextmanager
    def tracking(self, forward: bool = False, warming: bool = False):
        """Record device ops inside (forward: every op is a device op, as inside a model's forward;
        warming: compiles count as warmup's whatever the shard's phase)."""
        state = self._state
        state.forward += forward
        state.warming += warming
        outer = state.depth == 0
        state.depth += 1
        if outer:
            self._function.__enter__()
            self._dispatch.__enter__()
        try:
            yield
        finally:
            state.depth -= 1
            if outer:
                self._dispatch.__exit__(None, None, None)
                self._function.__exit__(None, None, None)
            state.forward -= forward
            state.warming -= warming

    # --- the rules ------------------------------------------------------------------------------

    def mark_step(self) -> None:
        """Run the pending graph: a compile if its key is new."""
        state = self._state
        if not state.pending:
            return
        key, new_ops = tuple(state.pending), state.new_ops
        state.pending, state.new_ops = [], []
        if key in self.cache:
            return
        phase = self.phase()
        if phase == "serving" and self.strict:
            raise UnwarmedShapeError(
                "a step would compile a new device graph after warmup: "
                + describe_new_ops(new_ops, key)
            )
        self.cache.add(key)
        self.known_ops.update(key)
        self.compiles[phase] += 1
        self.events.append(
            {"event": "compile", "phase": phase, "ops": len(key), "cause": _cause(new_ops, key)}
        )

    def graph_break(self, what: str, where: str) -> None:
        """A host read or a data-dependent shape: the pending graph runs here."""
        phase = self.phase()
        self.breaks[phase] += 1
        self.events.append({"event": "break", "phase": phase, "cause": f"{what} at {where}"})
        self.mark_step()

    def record(self, op_key: tuple) -> None:
        state = self._state
        state.pending.append(op_key)
        if self.serving and op_key not in self.known_ops and len(state.new_ops) < 4:
            state.new_ops.append((op_key, caller()))

    def reset(self) -> None:
        """A new KV cache: graphs over the old one are gone (counters stay: they are totals)."""
        self.cache.clear()
        self.known_ops.clear()
        self._state.pending.clear()

    def counts(self) -> dict:
        return {
            f"graph_{kind}_{phase}": counter[phase]
            for kind, counter in (("compiles", self.compiles), ("breaks", self.breaks))
            for phase in PHASES
        }


def _cause(new_ops: list, key: tuple) -> str:
    return (
        describe_new_ops(new_ops, key)
        if new_ops
        else f"a graph of {len(key)} ops, first {_op_text(key[0])}"
    )


def describe_new_ops(new_ops: list, key: tuple) -> str:
    if not new_ops:
        return f"a new sequence of {len(key)} known ops, first {_op_text(key[0])}"
    return "; ".join(f"{_op_text(op)} at {where}" for op, where in new_ops)


def _op_text(op_key: tuple) -> str:
    name, inputs, scalars = op_key
    shapes = ", ".join(f"{dtype}{list(shape)}" for shape, dtype in inputs)
    return f"{name}({shapes}{', ' if scalars and shapes else ''}{', '.join(map(str, scalars))})"


def _flatten(values):
    for value in values:
        if isinstance(value, (list, tuple)):
            yield from _flatten(value)
        else:
            yield value


def _short_dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class _Recorder(TorchDispatchMode):
    """Every aten op: a device op when it reads a device tensor (or runs inside a forward)."""

    def __init__(self, graphs: LazyGraphs):
        super().__init__()
        self.graphs = graphs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        values = list(_flatten(list(args) + list(kwargs.values())))
        state = self.graphs._state
        device = state.forward or any(is_on_device(v) for v in values)
        if not device or state.reading:
            return func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name in ("_local_scalar_dense", "is_nonzero"):
            if state.pending:
                self.graphs.graph_break(f"host read ({name})", caller())
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        outputs = [o for o in _flatten([out]) if isinstance(o, torch.Tensor)]
        for tensor in outputs:
            if tensor.dtype == torch.float64:
                raise Float64Error(
                    f"{func} makes a float64 tensor on the device (Gaudi has no float64), "
                    f"called from {caller()}"
                )
            on_device(tensor)
        if func.is_view or name in ("detach", "alias", "lift_fresh"):
            return out
        inputs = tuple(
            (tuple(v.shape), _short_dtype(v.dtype)) for v in values if isinstance(v, torch.Tensor)
        )
        scalars = tuple(
            _short_dtype(v) if isinstance(v, torch.dtype) else v
            for v in values
            if isinstance(v, (int, float, bool, str, torch.dtype)) or v is None
        )
        self.graphs.record((str(func), inputs, scalars))
        bool_index = name in ("index", "index_put", "index_put_") and any(
            isinstance(v, torch.Tensor) and v.dtype == torch.bool for v in values[1:]
        )
        if name in DATA_DEPENDENT or str(func) in DATA_DEPENDENT_OVERLOADS or bool_index:
            self.graphs.graph_break(f"data-dependent shape ({func})", caller())
        return out


class _HostReads(TorchFunctionMode):
    """Tensor methods that read a device tensor on the host: a break when a graph is pending."""

    def __init__(self, graphs: LazyGraphs):
        super().__init__()
        self.graphs = graphs

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if not (name in HOST_READS and args and is_on_device(args[0])):
            return func(*args, **(kwargs or {}))
        state = self.graphs._state
        if state.pending:
            self.graphs.graph_break(f"host read (.{name}())", caller())
        state.reading = True
        try:
            return func(*args, **(kwargs or {}))
        finally:
            state.reading = False
