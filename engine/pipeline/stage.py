"""A pipeline stage's forward: the first stage embeds the tokens, every other stage receives the
previous stage's hidden states; a stage runs its layers and sends its output on; the last stage
computes the logits and broadcasts them to every stage, so that every rank samples the same
tokens from them (the shard's step is then the same on every rank, as with tensor parallelism).

Every tensor that travels has the bucket's static shape: the hidden states are shaped like the
step's token ids plus the hidden size, the logits like `logits_indices` by the vocabulary.

Several steps may be in flight (engine/pipeline/turns.py): a stage that is not the last sends
its hidden states and posts the logits' broadcast without waiting, then waits for the logits under
the step's `pause` (if its shard gave one: `overlapping`), during which the next step launches its
own forward. Every rank posts the same operations in the same order on each group, whatever
overlaps.

Each forward records when this stage worked on it (`spans`: start and end, perf_counter_ns, and
the step's order): the raw material of the stage-utilization measurement in
scripts/bench_pipeline.py (engine/pipeline/measure.py)."""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager, nullcontext
from typing import NamedTuple

import torch
import torch.distributed as dist

from engine.pipeline.grid import Pipe

MAX_SPANS = 4096  # a long-running server keeps only the latest


class Span(NamedTuple):
    start: int  # perf_counter_ns: one clock for every process of the machine (CLOCK_MONOTONIC)
    end: int
    step: int  # the step's order (engine/pipeline/turns.py); 0: unordered


class PipelineStage:
    def __init__(self, pipe: Pipe, hidden_size: int, vocab_size: int, dtype: torch.dtype):
        self.pipe, self.hidden_size, self.vocab_size, self.dtype = (
            pipe,
            hidden_size,
            vocab_size,
            dtype,
        )
        self.spans: list[Span] = []  # this stage's own work, forward by forward
        self._step = threading.local()  # the calling thread's step: its order, its pause

    @contextmanager
    def overlapping(self, order: int, pause=None):
        """One step's forwards, labelled `order` in the spans. `pause`: a context manager that
        lets the next step run while this one waits for its logits; a step that has one runs a
        single forward (a second would launch out of the order every rank keeps: refused)."""
        self._step.order, self._step.pause, self._step.forwards = order, pause, 0
        try:
            yield
        finally:
            self._step.order, self._step.pause = 0, None

    def forward(self, model, input_ids, positions, meta, logits_indices, lora_index=None):
        pause = getattr(self._step, "pause", None)
        if pause is not None:
            self._step.forwards += 1
            if self._step.forwards > 1:
                raise RuntimeError("a pipelined step ran a second forward after its pause")
        hidden = self.receive_or_embed(model, input_ids)
        start = time.perf_counter_ns()
        hidden = model.run_layers(hidden, positions, meta, lora_index)
        if self.pipe.last:
            logits = model.final_logits(hidden, logits_indices)
            self._record(start)
            dist.broadcast(logits, src=self.pipe.last_rank, group=self.pipe.group)
            return logits
        hidden = hidden.contiguous()  # held until its send completes
        sent = dist.isend(hidden, dst=self.pipe.next_rank)
        logits = torch.empty(
            (logits_indices.shape[0], self.vocab_size), dtype=torch.float32, device=hidden.device
        )
        arriving = dist.broadcast(
            logits, src=self.pipe.last_rank, group=self.pipe.group, async_op=True
        )
        self._record(start)
        with pause() if pause is not None else nullcontext():
            arriving.wait()
        sent.wait()
        return logits

    def receive_or_embed(self, model, input_ids: torch.Tensor) -> torch.Tensor:
        if self.pipe.first:
            return model.embed(input_ids)
        hidden = torch.empty(
            (*input_ids.shape, self.hidden_size), dtype=self.dtype, device=input_ids.device
        )
        dist.recv(hidden, src=self.pipe.previous_rank)
        return hidden

    def _record(self, start: int) -> None:
        self.spans.append(Span(start, time.perf_counter_ns(), getattr(self._step, "order", 0)))
        if len(self.spans) > MAX_SPANS:
            del self.spans[: MAX_SPANS // 2]
