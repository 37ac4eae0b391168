"""Embed: prompts' pooled final hidden states (a bucketserve extension of generate.v3,
proto/CONTRACT.md). Every input is checked before the forward, which runs in the warmed plain
prefill buckets (engine/runner.py's embed) and holds no KV block."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from engine.batch import Embedding, EmbedInput
from engine.errors import InvalidRequestError
from engine.runner import ModelRunner


def check_inputs(
    inputs: list[EmbedInput],
    *,
    max_input_tokens: int,
    vocab_size: int,
    hidden_size: int,
    matryoshka: tuple[int, ...] | None,
) -> None:
    """Refuses the call for its first bad input, naming it."""
    if not inputs:
        raise InvalidRequestError("Embed needs at least one input")
    for item in inputs:
        if not item.token_ids:
            raise InvalidRequestError(f"input {item.id}: no tokens")
        if len(item.token_ids) > max_input_tokens:
            raise InvalidRequestError(
                f"input {item.id}: {len(item.token_ids)} tokens exceed "
                f"max_input_tokens={max_input_tokens}"
            )
        bad = next((t for t in item.token_ids if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidRequestError(
                f"input {item.id}: token id {bad} is not in the vocabulary (0..{vocab_size - 1})"
            )
        check_dimensions(item.dimensions, hidden_size, matryoshka)


def check_dimensions(dimensions: int, hidden_size: int, matryoshka: tuple[int, ...] | None) -> None:
    """`dimensions` 0 keeps the whole vector; any other size only where the model was trained for
    truncation (config.json's `is_matryoshka` or `matryoshka_dimensions`, as vLLM reads them):
    elsewhere a truncated vector is a worse embedding, not a shorter one, so it is refused."""
    if dimensions in (0, hidden_size):  # the whole vector, whatever the model
        return
    if matryoshka is None:
        raise InvalidRequestError(
            "`dimensions` is not supported by this model: its config.json declares no Matryoshka "
            "embeddings (`is_matryoshka` or `matryoshka_dimensions`)"
        )
    allowed = matryoshka or range(1, hidden_size + 1)
    if dimensions not in allowed or dimensions > hidden_size:
        sizes = ", ".join(map(str, matryoshka)) if matryoshka else f"1..{hidden_size}"
        raise InvalidRequestError(f"`dimensions` {dimensions} is not supported (allowed: {sizes})")


def embed_step(
    runner: ModelRunner, inputs: list[EmbedInput], longest_bucket: int
) -> list[Embedding]:
    """Each input's embedding: its first `dimensions` values, normalized again (Matryoshka)."""
    for item in inputs:
        if len(item.token_ids) > longest_bucket:
            raise InvalidRequestError(
                f"input {item.id}: {len(item.token_ids)} tokens exceed the longest prefill bucket "
                f"({longest_bucket} tokens), which an embedding must fit whole"
            )
    vectors = runner.embed([item.token_ids for item in inputs])
    return [
        Embedding(item.id, truncated(vector, item.dimensions).tolist())
        for item, vector in zip(inputs, vectors)
    ]


def truncated(vector: torch.Tensor, dimensions: int) -> torch.Tensor:
    if not dimensions or dimensions == vector.numel():
        return vector
    return F.normalize(vector[:dimensions], dim=-1)
