"""Chunked prefill on the shard: which prompt tokens each sequence computes in a step.

A prompt longer than the longest prefill bucket, or than the step's prefill budget, is computed in
chunks over successive steps (Prefill, then the Decodes that follow, next to the running decodes),
each chunk a prefill that continues the KV already cached (engine/attention/context.py). A request
may ask for a first chunk of `chunk_len` tokens (TGI's router does when it splits its budget); the
shard sizes the following chunks itself, as TGI's shards do. A sequence samples its first token
only when its last chunk is computed. A chunk never ends inside an image's tokens.
"""

from __future__ import annotations

from engine.batch import Request
from engine.errors import InvalidRequestError


def chunk_cap(longest_bucket: int, block_size: int) -> int:
    """Most new tokens of one sequence in one forward: the longest prefill bucket, in whole blocks
    where it holds one (so that later chunks continue whole blocks)."""
    return (
        longest_bucket // block_size * block_size
        if longest_bucket >= block_size
        else longest_bucket
    )


def plan_chunks(
    sequences, budget: int, cap: int, uncut: bool = False
) -> list[tuple[object, int, int]]:
    """(sequence, start, end) of the tokens each sequence computes now, under the step's budget of
    new tokens; a sequence the budget does not reach computes nothing this step (it waits).
    `uncut`: images are never cut (a model whose image tokens attend to each other both ways)."""
    planned, whole_step = [], min(cap, budget)
    for seq in sequences:
        size = min(seq.prefill_end - seq.computed, cap, budget)
        first = seq.request.chunk_len if seq.computed == seq.cache_len else None
        if first:
            size = min(size, first)
        room = min(whole_step, first) if first else whole_step  # the most it computes in a step
        most = min(cap, budget) if uncut else None
        end = whole_images(seq, seq.computed, seq.computed + size, room, most)
        if end > seq.computed:
            planned.append((seq, seq.computed, end))
            budget -= end - seq.computed
    return planned


def whole_images(seq, start: int, end: int, room: int, most: int | None = None) -> int:
    """The chunk's end moved so that it never ends inside an image: back to the start of an image
    that begins inside the chunk; back to the chunk's start (the sequence waits for a step with
    more budget) where the chunk begins at or inside an image whose rest fits in `room`. Only an
    image longer than `room` is cut (its features are sliced exactly). With `most` (the tokens
    this step may still compute, past a first chunk_len), an image is never cut: a chunk that
    begins at or inside it holds its rest whole where `most` allows, else it waits (the shard
    refuses an image longer than any step: ImageEncoder.check_whole)."""
    for first, last in getattr(seq, "image_spans", ()):
        if start < first < end < last:
            return first
        if first <= start < end < last and most is not None:
            return last if last - start <= most else start
        if first <= start < end < last and last - start <= room:
            return start
    return end


def check_chunking(request: Request, total_tokens: int, cap: int) -> None:
    if request.chunk_len is not None and request.chunk_len < 1:
        raise InvalidRequestError(
            f"request {request.id}: chunk_len={request.chunk_len}: a chunk computes at "
            "least one token (leave chunk_len unset for the whole prompt)"
        )
    if request.prefill_logprobs and total_tokens > cap:
        raise InvalidRequestError(
            f"request {request.id}: prefill_logprobs needs the whole prompt in one prefill, "
            f"and its {total_tokens} tokens exceed the longest ({cap})"
        )
    if (
        request.prefill_logprobs
        and request.chunk_len is not None
        and request.chunk_len < total_tokens
    ):
        raise InvalidRequestError(
            f"request {request.id}: prefill_logprobs needs the whole prompt in one chunk"
        )
