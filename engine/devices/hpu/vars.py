"""The Habana runtime variables a shard needs, as plain values: the launcher
(engine/devices/probe.py) puts them in each shard's environment and the HPU adapter checks them
(engine/devices/hpu/env.py). No imports from the rest of engine/devices, so both can use it."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

RECIPE_CACHE_MB = 8192  # compiled recipes of every bucket of a large model fit with room to spare
LAZY_MODES = ("graphs", "lazy")


def hpu_environment(graph_mode: str, world_size: int, cache_dir: Path | None) -> dict[str, str]:
    lazy = graph_mode in LAZY_MODES
    # Weight sharing keeps the host's copy of the weights mapped to the device (meant for training
    # checkpoints); TGI and vllm-gaudi turn it off for serving, which frees that memory.
    env = {"PT_HPU_LAZY_MODE": "1" if lazy else "0", "PT_HPU_WEIGHT_SHARING": "0"}
    if lazy and world_size > 1:
        # Collectives inside lazy-mode graphs (HPU graphs with tensor parallelism) need this.
        env["PT_HPU_ENABLE_LAZY_COLLECTIVES"] = "1"
    if cache_dir is not None:
        # Keep compiled recipes across restarts (delete-on-start False): a restart re-warms in
        # seconds instead of recompiling every bucket.
        env["PT_HPU_RECIPE_CACHE_CONFIG"] = (
            f"{Path(cache_dir) / 'hpu_recipes'},False,{RECIPE_CACHE_MB}"
        )
    return env


def launch_environment(
    graph_mode: str, world_size: int, cache_dir: Path | None, environ: Mapping[str, str]
) -> dict[str, str]:
    """What the launcher adds to every shard's environment: our values where the user set none."""
    return {
        k: v
        for k, v in hpu_environment(graph_mode, world_size, cache_dir).items()
        if k not in environ
    }
