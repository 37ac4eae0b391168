"""The scheduler's dealings with the KV blocks of one request: what it asks the allocator for at
admission (reusing cached prefix blocks), and what it tells the prefix cache the shard now holds."""

from __future__ import annotations

from engine.vision.keys import image_start, is_image_key
from router.sched.allocator import Allocation
from router.sched.streams import Entry


def prefill_ids(entry: Entry) -> list[int] | None:
    """The tokens its next prefill puts in the cache (prompt, and a resumed request's generated
    tokens), or None where the router did not tokenize it."""
    return None if entry.token_ids is None else entry.token_ids + entry.generated


def _lookup_ids(entry: Entry) -> list[int] | None:
    # Prompt logprobs need every prompt token computed: such a request reuses nothing.
    return None if entry.request.prefill_logprobs and not entry.generated else prefill_ids(entry)


def admit(allocator, entry: Entry, longest_prefill: int | None) -> Allocation | None:
    """Blocks for the request, its cached prefix reused; None when they do not fit now (it waits).
    With `longest_prefill` (the shards resume requests: router/sched/preemption.py), blocks for what
    it prefills only, more coming as it decodes, if it could be resumed at any point (its prompt and
    generated tokens always fit one prefill); otherwise blocks for all of max_new_tokens at once."""
    ids, adapter, tokens = (
        _lookup_ids(entry),
        entry.request.adapter_id,
        _tokens_now(entry, longest_prefill),
    )
    if not allocator.fits(tokens, ids, adapter):
        return None
    return allocator.allocate(tokens, ids, adapter)


def group_fits(allocator, group: list[Entry], longest_prefill: int | None) -> bool:
    """Whether every member of an n/best_of group (one prompt, one budget) would be admitted now.
    Asked before any member allocates, so a group that has to wait counts no prefix-cache
    lookups."""
    head = group[0]
    return allocator.fits(
        _tokens_now(head, longest_prefill),
        _lookup_ids(head),
        head.request.adapter_id,
        copies=len(group),
    )


def _tokens_now(entry: Entry, longest_prefill: int | None) -> int:
    if longest_prefill is not None and entry.kv_tokens <= longest_prefill:
        return entry.prefill_length
    return entry.kv_tokens


def prefilled(allocator, entries: list[Entry]) -> None:
    """A prefill succeeded: the full blocks it computed can be found by others. A chunked prompt's
    first chunk only: its rest is computed by later steps (`first_token` registers it then)."""
    for entry in entries:
        ids = prefill_ids(entry)
        if ids is not None and entry.allocation is not None:
            end = (
                entry.allocation.cache_len + entry.chunk_len
                if entry.chunk_len is not None
                else len(ids)
            )
            allocator.register(
                entry.allocation, ids[: _whole_images(ids, end)], entry.request.adapter_id
            )


def _whole_images(ids: list[int], end: int) -> int:
    """A chunk's end moved back to the start of an image it would cut: the shard computes an
    image's tokens in one forward (engine/serving/chunks.py), so they may not be in the cache
    yet."""
    if 0 < end < len(ids) and is_image_key(ids[end]) and image_start(ids, end) < end:
        return image_start(ids, end)
    return end


def first_token(allocator, entry: Entry) -> None:
    """A chunked prompt's first token came: the whole prompt is computed now."""
    if entry.chunk_len is not None:
        entry.chunk_len = None
        prefilled(allocator, [entry])


def finished(allocator, entry: Entry) -> None:
    """Before its blocks go back: what the cache holds of a request that decoded (its prompt and
    every generated token but the last, which was never fed back): the next turn of a chat finds
    it."""
    if entry.token_ids is not None and entry.allocation is not None and entry.generated:
        allocator.register(
            entry.allocation, entry.token_ids + entry.generated[:-1], entry.request.adapter_id
        )
