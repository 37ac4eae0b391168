"""Decode lookahead (async scheduling): a batch's next forward runs while the router is still busy
with the step before.

A decode answer travels to the router, which hands each token to its stream and only then sends
the next Decode; the shard waits meanwhile. When the router says it will decode the same batch
again (DecodeRequest.look_ahead, router/sched/scheduler.py), the shard runs that next forward at
once, right after answering, and keeps the logits here. The next step takes the rows it finds
(same sequence, same length), runs only the rest, and samples as usual: sampling, stopping and
seeded generators all move at the step itself, so a lookahead changes no token and no random draw.

A lookahead writes one KV slot per row, in a block the row already holds: the keys and values of
its latest token, the very values its step would write. So nothing is undone when a row leaves
before its step (cancelled, preempted): its blocks hold correct contents, and are freed with it.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from engine.devices.row_merge import merge_rows
from engine.runner import DecodeInput, ModelRunner
from engine.serving.recompute import decode_logits
from engine.serving.sequence import Sequence


@dataclass
class Ahead:
    """Logits of the next token of some sequences, computed before their step."""

    rows: dict[
        int, tuple[Sequence, int, int]
    ]  # sequence id -> (the sequence, its length then, row)
    logits: torch.Tensor
    forward_ns: int

    def covers(self, sequences: list[Sequence]) -> bool:
        """Whether any of these sequences' next logits are here."""
        return any(self.row_of(seq) is not None for seq in sequences)

    def row_of(self, seq: Sequence) -> int | None:
        """The row computed for this sequence at its current length, or None."""
        found = self.rows.get(seq.id)
        if found is None or found[0] is not seq or found[1] != len(seq.token_ids):
            return None
        return found[2]


def run_ahead(runner: ModelRunner, sequences: list[Sequence], inputs: list[DecodeInput]) -> Ahead:
    start = time.perf_counter_ns()
    logits = decode_logits(runner, sequences, inputs)
    rows = {seq.id: (seq, len(seq.token_ids), row) for row, seq in enumerate(sequences)}
    return Ahead(rows, logits, time.perf_counter_ns() - start)


def logits_using(
    ahead: Ahead | None, runner: ModelRunner, sequences: list[Sequence], inputs: list[DecodeInput]
) -> torch.Tensor:
    """Logits [len(sequences), vocab] of this step, the rows the lookahead computed taken from
    it."""
    found = [ahead.row_of(seq) if ahead is not None else None for seq in sequences]
    if all(row is None for row in found):
        return decode_logits(runner, sequences, inputs)
    missing = [i for i, row in enumerate(found) if row is None]
    computed = None
    if missing:  # rows that joined after the lookahead ran (a batch concatenated to this one)
        computed = decode_logits(
            runner, [sequences[i] for i in missing], [inputs[i] for i in missing]
        )
    if runner.adapter.warm_runs_forward:
        return _merged(runner, ahead.logits, found, computed, missing)
    rows = [ahead.logits[row] if row is not None else None for row in found]
    for i, logits in zip(missing, computed if computed is not None else []):
        rows[i] = logits
    return torch.stack(rows)


def _merged(runner: ModelRunner, early, found: list, computed, missing: list[int]) -> torch.Tensor:
    """The rows of the lookahead's bucket output that this step uses, and the rows computed now,
    merged at the plan's shapes (engine/devices/row_merge.py): stacking them would make a tensor
    as tall as this step's batch, a new graph for every mix on a graph device. The lookahead's
    rows that left the batch go to the buffer's scratch row."""
    count = len(found)
    rows = runner.plan.sampler_rows(count)
    source = getattr(early, "bucket_output", early)
    destinations = [rows] * source.shape[0]
    for i, row in enumerate(found):
        if row is not None:
            destinations[row] = i
    parts = [(source, destinations)]
    if computed is not None:
        parts.append((getattr(computed, "bucket_output", computed), missing))
    return merge_rows(runner.adapter, parts, count, rows)
