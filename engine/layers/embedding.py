"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous range of token rows."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.distributed import Parallel, all_gather_last_dim, all_reduce_sum
from engine.layers.linear import copy_checked, dense_linear


class VocabParallelEmbedding(nn.Module):
    def __init__(self, vocab_size: int, hidden_size: int, parallel: Parallel):
        super().__init__()
        self.vocab_size, self.hidden_size, self.parallel = vocab_size, hidden_size, parallel
        # Equal partitions (the last one padded with zero rows) keep the gathered logits in order.
        self.rows_per_rank = -(-vocab_size // parallel.world_size)
        self.start = parallel.rank * self.rows_per_rank
        self.end = min(self.start + self.rows_per_rank, vocab_size)
        self.weight = nn.Parameter(torch.empty(self.rows_per_rank, hidden_size))
        self.quantized = (
            None  # an Int8Weight (engine.weights.quantize), which then replaces `weight`
        )

    def lookup(self, ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(ids, self.weight) if self.quantized is None else self.quantized.rows(ids)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.parallel.world_size == 1:
            return self.lookup(ids)
        mine = (ids >= self.start) & (ids < self.end)
        local = self.lookup((ids - self.start) * mine) * mine.unsqueeze(-1)
        return all_reduce_sum(local, self.parallel)

    def load(self, kind: str, part, source, name: str) -> None:
        with torch.no_grad():
            self.weight[self.end - self.start :].zero_()
        copy_checked(
            self.weight[: self.end - self.start],
            source,
            slice(self.start, self.end),
            (self.vocab_size, self.hidden_size),
            name,
        )


class ParallelLMHead(VocabParallelEmbedding):
    """Logits for this rank's vocabulary range, gathered into the full vocabulary on every rank."""

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        local = (
            dense_linear(hidden, self.weight)
            if self.quantized is None
            else self.quantized.linear(hidden)
        )
        return all_gather_last_dim(local, self.parallel)[..., : self.vocab_size]
