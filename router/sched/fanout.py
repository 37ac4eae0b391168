"""Several sequences for one prompt (OpenAI `n`, TGI `best_of`) that share one prefill.

A group is `count` requests, the first one as submitted and its siblings with their own ids and
seeds: sibling k samples with seed + k (mod 2**64), so a group with a seed is reproducible and its
sequences differ whenever sampling does; a greedy group gives `count` equal sequences. The group
is queued together and admitted together (`leading_group`): at admission its first live member
becomes the source whose prompt the shard computes, and every other member names it in
`prefill_source` (a generate.v3 extension) so the shard copies that prompt's KV into its own blocks
instead of computing it again (engine/serving/siblings.py). Each member keeps its own allocation,
stream and finish; a cancelled member leaves the others running.
"""

from __future__ import annotations

from collections import deque
from dataclasses import replace

from engine.batch import Request, kv_tokens
from engine.config import ServingLimits
from router.sched.admission import check_request
from router.sched.allocator import BlockAllocator
from router.sched.streams import Entry

MAX_SIBLINGS = (
    8  # sequences per request (`n`, `best_of`): each holds a batch row and its own KV blocks
)
SEED_SPACE = 2**64


def check_count(name: str, count: int, max_batch_size: int) -> str | None:
    """Why `count` sequences cannot be served together (None: they can)."""
    limit = min(MAX_SIBLINGS, max_batch_size)
    if not 1 <= count <= limit:
        return f"`{name}` must be >= 1 and <= {limit}. Given: {count}"
    return None


def check_group(
    requests: list[Request],
    input_length: int,
    limits: ServingLimits,
    allocator: BlockAllocator,
    in_use,
    chunking: bool = False,
) -> None:
    """Refuse (ValueError) a group that could never run: each request on its own, and all of them
    in the KV cache at once (they are admitted together)."""
    for request in requests:
        if request.id in in_use:
            raise ValueError(f"request id {request.id} is already in use")
        check_request(request, input_length, limits, allocator, chunking)
    needed = sum(
        allocator.blocks_for(kv_tokens(input_length, r.stopping_parameters.max_new_tokens))
        for r in requests
    )
    if needed > allocator.num_blocks - 1:  # block 0 is reserved
        raise ValueError(
            f"{len(requests)} sequences of {input_length} prompt tokens need {needed} KV blocks, "
            f"the cache has {allocator.num_blocks - 1}"
        )


def siblings(request: Request, count: int, next_id) -> list[Request]:
    """The group: `request` first, then count - 1 copies with new ids from `next_id()` and seeds
    request's seed + k; each names `request` as the source of its prompt's KV."""
    seed = request.parameters.seed
    group = [request]
    for k in range(1, count):
        parameters = replace(request.parameters, seed=(seed + k) % SEED_SPACE)
        group.append(
            replace(request, id=next_id(), parameters=parameters, prefill_source=request.id)
        )
    return group


def leading_group(queue: deque[Entry]) -> list[Entry]:
    """The head of the queue with the queued members of its group right behind it (they are queued
    together and requeued in order, so they stay adjacent); a lone request is a group of one."""
    head = queue[0]
    if head.group is None:
        return [head]
    members = [head]
    for entry in list(queue)[1:]:
        if entry.group != head.group:
            break
        members.append(entry)
    return members


def share_prompt(members: list[Entry]) -> None:
    """Point every member at the first as its prompt's source (a resumed member, which prefills its
    own generated tokens, is computed by the shard on its own whatever it names)."""
    source = members[0].id if len(members) > 1 else None
    for entry in members:
        entry.request = replace(
            entry.request, prefill_source=None if entry.id == source else source
        )


def prefill_tokens(members: list[Entry]) -> int:
    """Tokens the group's prefill computes: one prompt, plus what resumed members re-prefill."""
    return members[0].prefill_length + sum(e.prefill_length for e in members[1:] if e.generated)


def split(members: list[Entry]) -> None:
    """Members that cannot share one prefill (a prompt beyond the prefill budget is computed in
    chunks) go on as lone requests; with prefix caching the later ones find the first's blocks."""
    for entry in members:
        entry.group = None


class Streams:
    """The streams of one group, closed together (a client that goes away cancels all of them)."""

    def __init__(self, streams: list):
        self.streams = streams

    def close(self) -> None:
        for stream in self.streams:
            stream.close()
