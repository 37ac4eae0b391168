"""What the shard checks in what a router assigns: batch ids, KV blocks and slots.

A v3 router owns the KV blocks, so a wrong assignment would otherwise reach the device: a block
past the cache is an out-of-bounds write (a device-side fault on CUDA or HPU), two live requests
on one block corrupt each other's keys and values, and a reused batch id orphans the old batch's
blocks. Each is refused with InvalidRequestError (INVALID_ARGUMENT) naming the field, before any
state changes.
"""

from __future__ import annotations

from engine.batch import Batch, CachedBatch, Request
from engine.errors import InvalidRequestError
from engine.kv_cache import RESERVED_BLOCK

# TGI's router health probe: one token on the reserved block, which padding writes to anyway.
PROBE_BLOCKS = [RESERVED_BLOCK]


def check_prefill(
    batch: Batch, cached: CachedBatch | None, live: dict, num_blocks: int, block_size: int
) -> None:
    """`live`: batch id -> its sequences (each with `.id` and `.blocks`)."""
    if cached is not None and cached.id not in live:
        raise KeyError(f"cached_batch.id: batch {cached.id} not found")
    if batch.id in live and (cached is None or cached.id != batch.id):
        raise InvalidRequestError(
            f"batch.id: batch {batch.id} is already live (FilterBatch or ClearCache it first)"
        )
    owners = {
        block: seq.id for sequences in live.values() for seq in sequences for block in seq.blocks
    }
    writers: dict[int, int] = {}  # blocks this batch's requests write
    for request in batch.requests:
        check_blocks(request, owners, num_blocks, block_size, writers)
        check_slots(request, block_size)
        shared = request.cache_len // block_size
        owners.update((block, request.id) for block in request.blocks if block != RESERVED_BLOCK)
        writers.update((block, request.id) for block in request.blocks[shared:])


def check_blocks(
    request: Request,
    owners: dict[int, int],
    num_blocks: int,
    block_size: int = 1,
    writers: dict[int, int] | None = None,
) -> None:
    """A request's prefix blocks (its first cache_len tokens) are read only and may be shared with
    other requests (prefix caching); every block it writes must be its own."""
    if request.blocks == PROBE_BLOCKS:
        return
    seen, shared, writers = set(), request.cache_len // block_size, writers or {}
    for index, block in enumerate(request.blocks):
        if not RESERVED_BLOCK < block < num_blocks:
            raise InvalidRequestError(
                f"request {request.id}: blocks: block {block} is not in the KV cache's "
                f"usable blocks 1..{num_blocks - 1} (block 0 is reserved)"
            )
        if block in seen:
            raise InvalidRequestError(
                f"request {request.id}: blocks: block {block} is listed twice"
            )
        if index < shared and block in writers:
            raise InvalidRequestError(
                f"request {request.id}: blocks: prefix block {block} is being written by "
                f"request {writers[block]} of the same batch"
            )
        if index >= shared and block in owners:
            raise InvalidRequestError(
                f"request {request.id}: blocks: block {block} is in use by live request "
                f"{owners[block]}"
            )
        seen.add(block)


def check_slots(request: Request, block_size: int) -> None:
    if request.slots and not request.blocks:
        raise InvalidRequestError(f"request {request.id}: slots: given without blocks")
    own = set(request.blocks)
    for slot in request.slots:
        if slot // block_size not in own:
            raise InvalidRequestError(
                f"request {request.id}: slots: slot {slot} is outside the request's own blocks"
            )


def check_decode(batches: list[CachedBatch]) -> None:
    if not batches:
        raise InvalidRequestError("batches: decode needs at least one batch")
    ids = [b.id for b in batches]
    if len(set(ids)) != len(ids):
        raise InvalidRequestError(f"batches: a batch is listed twice ({ids})")


def check_grown(grown: dict[int, list[int]], sequences: list, live: dict, num_blocks: int) -> None:
    """Blocks a router hands running requests before a Decode (KV on demand): each request must be
    in the step, each block usable and held by no live request, none given twice."""
    ids = {seq.id for seq in sequences}
    owners = {block: seq.id for batch in live.values() for seq in batch for block in seq.blocks}
    given: set[int] = set()
    for request_id, blocks in grown.items():
        if request_id not in ids:
            raise InvalidRequestError(
                f"grown_request_ids: request {request_id} is not in the decoded batches"
            )
        for block in blocks:
            where = f"request {request_id}: grown_blocks: block {block}"
            if not RESERVED_BLOCK < block < num_blocks:
                raise InvalidRequestError(
                    f"{where} is not in the KV cache's usable blocks 1..{num_blocks - 1}"
                )
            if block in owners or block in given:
                raise InvalidRequestError(
                    f"{where} is in use by request {owners.get(block, request_id)}"
                )
            given.add(block)
