"""A pipeline stage's forward: the first stage embeds the tokens, every other stage receives the
previous stage's hidden states; a stage runs its layers and sends its output on; the last stage
computes the logits and broadcasts them to every stage, so that every rank samples the same
tokens from them (the shard's step is then the same on every rank, as with tensor parallelism).

Every tensor that travels has the bucket's static shape: the hidden states are shaped like the
step's token ids plus the hidden size, the logits like `logits_indices` by the vocabulary.

Each forward records when this stage worked on it (`spans`, perf_counter_ns): the raw material
of a stage-utilization measurement (docs/multinode.md says what is measured so far)."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

from engine.pipeline.grid import Pipe

MAX_SPANS = 4096  # a long-running server keeps only the latest


class PipelineStage:
    def __init__(self, pipe: Pipe, hidden_size: int, vocab_size: int, dtype: torch.dtype):
        self.pipe, self.hidden_size, self.vocab_size, self.dtype = (
            pipe,
            hidden_size,
            vocab_size,
            dtype,
        )
        self.spans: list[tuple[int, int]] = []  # (start, end) of this stage's own work

    def forward(self, model, input_ids, positions, meta, logits_indices, lora_index=None):
        hidden = self.receive_or_embed(model, input_ids)
        start = time.perf_counter_ns()
        hidden = model.run_layers(hidden, positions, meta, lora_index)
        if self.pipe.last:
            logits = model.final_logits(hidden, logits_indices)
        else:
            dist.send(hidden.contiguous(), dst=self.pipe.next_rank)
            logits = torch.empty(
                (logits_indices.shape[0], self.vocab_size),
                dtype=torch.float32,
                device=hidden.device,
            )
        self._record(start)
        dist.broadcast(logits, src=self.pipe.last_rank, group=self.pipe.group)
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
        self.spans.append((start, time.perf_counter_ns()))
        if len(self.spans) > MAX_SPANS:
            del self.spans[: MAX_SPANS // 2]
