"""Graph compiles and graph breaks per phase, whatever the device: the simulator's own counts; in
compile mode torch's own (dynamo's counters, with its recompiles: engine/devices/dynamo.py); on
a real HPU Habana's runtime metric (`habana_frameworks.torch.hpu.metrics`); on CUDA graph devices
the graphs captured. Serving's share is what was counted after the shard's warmup ended."""

from __future__ import annotations

from engine.devices.dynamo import KINDS, ledger_of
from engine.devices.simulate.lazy import PHASES

ZERO = {f"graph_{kind}_{phase}": 0 for kind in KINDS for phase in PHASES}


def start_warmup(adapter) -> None:
    if hasattr(adapter, "graphs"):
        adapter.graphs.serving = False
    adapter._graph_base = None
    ledger_of(adapter).start_warmup()


def start_serving(adapter) -> None:
    """Warmup is over: from here a new graph is a serving compile (refused in strict mode)."""
    ledger_of(adapter).start_serving()
    if hasattr(adapter, "graphs"):
        adapter.graphs.serving = True
        # --warmup none (or strict shapes off): every first shape compiles, counted, not refused
        adapter.graphs.strict = adapter.shapes.strict
    adapter._graph_base = _device_compiles(adapter)


def graph_counts(adapter) -> dict:
    if hasattr(getattr(adapter, "graphs", None), "counts"):  # the simulator's (not CUDA's GraphSet)
        return {**ZERO, **adapter.graphs.counts()}
    if adapter.graph_mode == "compile":
        return ledger_of(adapter).counts()
    counts = dict(ZERO)
    total, base = _device_compiles(adapter), getattr(adapter, "_graph_base", None)
    if base is None:
        counts["graph_compiles_warmup"] = total
    else:
        counts["graph_compiles_warmup"], counts["graph_compiles_serving"] = base, total - base
    return counts


def _device_compiles(adapter) -> int:
    """Habana's count of graph compilations where its metrics exist, else the graphs captured."""
    metric = _habana_compiles(adapter)
    if metric is not None:
        return metric
    return sum(
        count for (kind, _), count in adapter.stats.items() if kind in ("capture", "compiled")
    )


def _habana_compiles(adapter) -> int | None:
    htorch = getattr(adapter, "htorch", None)
    metrics = getattr(getattr(htorch, "hpu", None), "metrics", None)
    if metrics is None or not hasattr(metrics, "metric_global"):
        return None
    try:
        stats = dict(metrics.metric_global("graph_compilation").stats())
    except Exception:  # noqa: BLE001 - a bridge without the metric: count captures instead
        return None
    return int(stats.get("TotalNumber", 0))
