"""Every rank of a group must serve the same model: the nodes of a multi-node group are started
separately, and a node started with another model would otherwise compute garbage or hang."""

from __future__ import annotations

import hashlib
from pathlib import Path

from engine.distributed import Parallel, gather_objects
from engine.errors import ModelLoadError
from engine.weights.paths import resolve_model_dir


def model_identity(model_dir: Path) -> str:
    """A digest of the model's config.json and of its weight files' names and sizes."""
    digest = hashlib.sha256((model_dir / "config.json").read_bytes())
    for weights in sorted(model_dir.glob("*.safetensors")):
        digest.update(f"{weights.name}:{weights.stat().st_size}".encode())
    return digest.hexdigest()[:16]


def check_same_model(config, world: Parallel) -> None:
    """Raise on every rank when any rank's model differs from rank 0's."""
    if world.world_size == 1:
        return
    model_dir = resolve_model_dir(config.model_id, config.resolved_cache_dir)
    mine = (str(model_dir), model_identity(model_dir))
    everyone = gather_objects(mine, world)
    others = [rank for rank, theirs in enumerate(everyone) if theirs[1] != everyone[0][1]]
    if others:
        first = others[0]
        raise ModelLoadError(
            f"the ranks serve different models: rank 0 has {everyone[0][0]} "
            f"(digest {everyone[0][1]}), rank {first} has {everyone[first][0]} "
            f"(digest {everyone[first][1]}); start every node with the same --model-id"
        )
    if config.pipeline_parallel_size > 1 and config.lora_adapters:
        raise ModelLoadError("--pipeline-parallel-size does not combine with --lora-adapters yet")
