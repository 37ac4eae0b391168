"""The Habana runtime's environment. The bridge reads it when habana_frameworks is first imported,
so the adapter sets it before that import; a value the user already set wins, except a lazy mode
that contradicts the requested graph mode, which is refused in one line."""
from __future__ import annotations

from pathlib import Path
from typing import MutableMapping

from engine.devices.probe import DeviceError

RECIPE_CACHE_MB = 8192  # compiled recipes of every bucket of a large model fit with room to spare


def hpu_environment(graph_mode: str, world_size: int, cache_dir: Path | None) -> dict[str, str]:
    lazy = graph_mode != "compile"
    env = {"PT_HPU_LAZY_MODE": "1" if lazy else "0"}
    if lazy and world_size > 1:
        # Collectives inside lazy-mode graphs (HPU graphs with tensor parallelism) need this.
        env["PT_HPU_ENABLE_LAZY_COLLECTIVES"] = "1"
    if cache_dir is not None:
        # Keep compiled recipes across restarts (delete-on-start False): a restart re-warms in
        # seconds instead of recompiling every bucket.
        env["PT_HPU_RECIPE_CACHE_CONFIG"] = f"{Path(cache_dir) / 'hpu_recipes'},False,{RECIPE_CACHE_MB}"
    return env


def apply_environment(wanted: dict[str, str], environ: MutableMapping[str, str]) -> None:
    current = environ.get("PT_HPU_LAZY_MODE")
    if current is not None and current != wanted["PT_HPU_LAZY_MODE"]:
        mode = "lazy mode (graphs or lazy)" if wanted["PT_HPU_LAZY_MODE"] == "1" else "compile mode"
        raise DeviceError(f"--graph-mode needs {mode}, but PT_HPU_LAZY_MODE={current} is set: "
                          f"set PT_HPU_LAZY_MODE={wanted['PT_HPU_LAZY_MODE']} or choose another --graph-mode")
    for key, value in wanted.items():
        environ.setdefault(key, value)
