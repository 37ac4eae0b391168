"""Which layers each pipeline stage holds, the stage's model configuration, and which checkpoint
tensors it reads: a stage reads only its own layers (and the embedding on the first stage, the
final norm and the LM head on the last)."""

from __future__ import annotations

import dataclasses
import re

from engine.models.config import ModelConfig

LAYER_NAME = re.compile(r"layers\.(\d+)\.")
FIRST_STAGE_MODULES = ("embed_tokens.",)
LAST_STAGE_MODULES = ("norm.", "lm_head.")


def layer_ranges(num_layers: int, stages: int) -> list[range]:
    """Consecutive layers per stage, as even as they divide; the first stages take one more each
    where they do not (the last stage also runs the LM head)."""
    if stages > num_layers:
        raise ValueError(
            f"--pipeline-parallel-size {stages} is larger than the model's {num_layers} layers"
        )
    base, extra = divmod(num_layers, stages)
    ranges, start = [], 0
    for stage in range(stages):
        count = base + (stage < extra)
        ranges.append(range(start, start + count))
        start += count
    return ranges


def stage_config(config: ModelConfig, layers: range) -> ModelConfig:
    """The configuration of a model made of `layers` only: its per-layer fields sliced, so that
    local layer i of the stage is global layer layers.start + i."""
    window = slice(layers.start, layers.stop)
    moe = config.moe
    if moe is not None:
        moe = dataclasses.replace(moe, sparse_layers=moe.sparse_layers[window])
    return dataclasses.replace(
        config,
        num_layers=len(layers),
        layer_types=config.layer_types[window] if config.layer_types else (),
        moe=moe,
    )


@dataclasses.dataclass(frozen=True)
class StageWeights:
    """Which checkpoint tensors a stage reads, and under which of its own names."""

    layers: range
    first: bool
    last: bool
    tied: bool  # tie_word_embeddings: the last stage's LM head is the embedding

    def local_name(self, name: str) -> str | None:
        """The stage's name for checkpoint tensor `name` (model. prefix removed), or None when
        another stage holds it."""
        match = LAYER_NAME.match(name)
        if match:
            layer = int(match.group(1))
            if layer not in self.layers:
                return None
            return f"layers.{layer - self.layers.start}.{name[match.end() :]}"
        if name.startswith(FIRST_STAGE_MODULES):
            return name if self.first or (self.last and self.tied) else None
        if name.startswith(LAST_STAGE_MODULES):
            return name if self.last else None
        return name


def split_for_stage(
    config: ModelConfig, stage: int, stages: int
) -> tuple[ModelConfig, StageWeights]:
    """The stage's model configuration and the checkpoint tensors it reads."""
    layers = layer_ranges(config.num_layers, stages)[stage]
    weights = StageWeights(layers, stage == 0, stage == stages - 1, config.tie_word_embeddings)
    return stage_config(config, layers), weights


def trim_to_stage(model, weights: StageWeights) -> None:
    """Drop the modules another stage runs (before the model is allocated: they never hold
    memory, and the loader expects no tensor for them)."""
    if not (weights.first or (weights.last and weights.tied)):
        model.embed_tokens = None
    if not weights.last:
        model.norm = None
        model.lm_head = None
