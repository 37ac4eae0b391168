"""The Habana runtime's environment.

The bridge reads PT_HPU_LAZY_MODE once, when it is imported, and current releases import it with
`import torch` (torch's device-backend autoload), so a shard cannot choose its mode itself: the
launcher puts these variables in each shard's environment (DevicePlan), a value the user already
set wins, and the adapter checks after import that the bridge really runs in the mode its graph
mode needs. The other variables are read when the runtime initialises; the adapter also sets them
(if absent) before its first import, for an engine started without the launcher.
"""
from __future__ import annotations

from pathlib import Path
from typing import Mapping, MutableMapping

from engine.devices.probe import DeviceError

RECIPE_CACHE_MB = 8192  # compiled recipes of every bucket of a large model fit with room to spare
LAZY_MODES = ("graphs", "lazy")


def hpu_environment(graph_mode: str, world_size: int, cache_dir: Path | None) -> dict[str, str]:
    lazy = graph_mode in LAZY_MODES
    env = {"PT_HPU_LAZY_MODE": "1" if lazy else "0"}
    if lazy and world_size > 1:
        # Collectives inside lazy-mode graphs (HPU graphs with tensor parallelism) need this.
        env["PT_HPU_ENABLE_LAZY_COLLECTIVES"] = "1"
    if cache_dir is not None:
        # Keep compiled recipes across restarts (delete-on-start False): a restart re-warms in
        # seconds instead of recompiling every bucket.
        env["PT_HPU_RECIPE_CACHE_CONFIG"] = f"{Path(cache_dir) / 'hpu_recipes'},False,{RECIPE_CACHE_MB}"
    return env


def launch_environment(graph_mode: str, world_size: int, cache_dir: Path | None,
                       environ: Mapping[str, str]) -> dict[str, str]:
    """What the launcher adds to every shard's environment: our values where the user set none."""
    return {k: v for k, v in hpu_environment(graph_mode, world_size, cache_dir).items() if k not in environ}


def apply_environment(wanted: dict[str, str], environ: MutableMapping[str, str]) -> None:
    current = environ.get("PT_HPU_LAZY_MODE")
    if current is not None and current != wanted["PT_HPU_LAZY_MODE"]:
        raise DeviceError(_mode_message(wanted["PT_HPU_LAZY_MODE"] == "1", f"PT_HPU_LAZY_MODE={current} is set"))
    for key, value in wanted.items():
        environ.setdefault(key, value)


def check_bridge_mode(htorch, lazy: bool, graph_mode: str) -> None:
    """The mode the bridge started in (it read PT_HPU_LAZY_MODE at import) against the one we need."""
    running = bool(htorch.utils.internal.is_lazy())
    if running != lazy:
        started = "lazy" if running else "eager"
        raise DeviceError(_mode_message(lazy, f"the Habana bridge started in {started} mode", graph_mode))


def _mode_message(lazy: bool, found: str, graph_mode: str | None = None) -> str:
    needed = "lazy mode" if lazy else "eager mode (compile)"
    value = "1" if lazy else "0"
    which = f"--graph-mode {graph_mode}" if graph_mode else "--graph-mode"
    return (f"{which} needs the Habana bridge in {needed}, but {found}: set PT_HPU_LAZY_MODE={value} in the "
            "environment before the engine starts (the bridge reads it when torch is imported; the launcher "
            "sets it for its shards) or choose another --graph-mode")
