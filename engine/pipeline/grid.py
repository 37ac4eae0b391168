"""The stages x tensor-parallel grid: rank r is tensor-parallel rank r % tp of stage r // tp (tp
= world size / stages), so that the ranks of one node, numbered consecutively by the launcher,
form a stage's tensor-parallel group (TP within a node, PP across nodes).

Every rank creates every group, in the same order, as torch.distributed requires."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist

from engine.distributed import Parallel


@dataclass(frozen=True)
class Pipe:
    """This rank's place in the pipeline; `group`: its tensor-parallel rank across all stages
    (the last stage broadcasts the logits over it, so that every rank samples alike)."""

    stage: int
    stages: int
    tp_size: int
    rank: int  # in the whole world
    group: object = field(default=None, compare=False)

    @property
    def first(self) -> bool:
        return self.stage == 0

    @property
    def last(self) -> bool:
        return self.stage == self.stages - 1

    @property
    def previous_rank(self) -> int:
        return self.rank - self.tp_size

    @property
    def next_rank(self) -> int:
        return self.rank + self.tp_size

    @property
    def last_rank(self) -> int:
        return self.rank + (self.stages - 1 - self.stage) * self.tp_size


def grid_problem(world_size: int, stages: int) -> str | None:
    """Why `world_size` ranks cannot form `stages` stages, or None."""
    if stages < 1:
        return f"--pipeline-parallel-size must be at least 1, not {stages}"
    if world_size % stages:
        return f"the world size {world_size} is not a multiple of --pipeline-parallel-size {stages}"
    return None


def place(rank: int, world_size: int, stages: int) -> tuple[Parallel, Pipe | None]:
    """This rank's tensor-parallel place and pipeline place, without groups (for checks)."""
    problem = grid_problem(world_size, stages)
    if problem:
        raise ValueError(problem)
    if stages == 1:
        return Parallel(rank, world_size), None
    tp = world_size // stages
    return Parallel(rank % tp, tp), Pipe(rank // tp, stages, tp, rank)


def join_grid(rank: int, world_size: int, stages: int) -> tuple[Parallel, Pipe | None]:
    """The groups of the grid (torch.distributed is initialized over the whole world)."""
    parallel, pipe = place(rank, world_size, stages)
    if pipe is None:
        return parallel, None
    tp = pipe.tp_size
    stage_groups = [dist.new_group(list(range(s * tp, (s + 1) * tp))) for s in range(stages)]
    pipe_groups = [dist.new_group([t + s * tp for s in range(stages)]) for t in range(tp)]
    tp_group = stage_groups[pipe.stage] if tp > 1 else None
    # A one-rank stage's collectives are identities: Parallel(0, 1) never calls them.
    return (
        Parallel(parallel.rank, tp, tp_group),
        Pipe(pipe.stage, stages, tp, rank, pipe_groups[parallel.rank]),
    )
