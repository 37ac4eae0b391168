"""KV-cache events in vLLM's wire format, published over ZMQ from the router's prefix cache.

The schema is vLLM's `vllm/distributed/kv_events.py` as of 2026 (msgspec structs; the batch a
positional array `[ts, events]`, each event a map tagged by its class name under "type"); the
framing is its ZmqEventPublisher's: a PUB socket sending `[topic, 8-byte big-endian sequence
number, msgpack payload]` (unchanged since vllm commit b4e69e0af33f4698e157a262cc787fe61983cd3d).
What a consumer needs is what vllm-router 0.1.17 reads (vllm-project/router src/kv_index/wire.rs
at 0e7a5e1): BlockStored(block_hashes, parent_block_hash, token_ids, block_size, lora_id, medium,
lora_name), BlockRemoved(block_hashes, medium), AllBlocksCleared(). Fields with defaults that vLLM
omits (extra_keys, group_idx, ...) are left out here too.

A block's hash is the prefix cache's chain hash (engine.wire.contract.chain_hashes) read as an
unsigned 64-bit integer (vllm-router refuses negative ones). Consumers compare hashes only with
hashes from the same publisher, and key their own index by the token ids (vllm-router re-hashes
them; llm-d likewise).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import zmq

MEDIUM = "GPU"  # vLLM's MEDIUM_GPU: the accelerator's own KV cache (HPU memory here)
HASH_MASK = (1 << 64) - 1  # Python's hashes are signed 64-bit integers
SEND_HWM = 100_000  # vLLM's default high-water mark: beyond it a slow subscriber loses batches


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    """Base class of the events: maps tagged by class name under "type", as in vLLM."""


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


class KvEventPublisher:
    """The prefix cache's listener (router/sched/prefix_cache.py calls stored, removed, cleared).

    Events of one event-loop turn go out as one batch: a step that registers and evicts blocks
    publishes them together, in order. Without a running loop (offline use) each goes at once.
    `endpoint` with `*` (tcp://*:5557) is bound, as vLLM does; any other is connected to."""

    def __init__(self, endpoint: str, topic: str = "", adapters: tuple[str, ...] = ()):
        self._socket = zmq.Context.instance().socket(zmq.PUB)
        self._socket.set_hwm(SEND_HWM)
        self._socket.setsockopt(zmq.LINGER, 0)
        if "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://")):
            self._socket.bind(endpoint)
        else:
            self._socket.connect(endpoint)
        self.endpoint = self._socket.getsockopt_string(zmq.LAST_ENDPOINT) or endpoint
        self._topic = topic.encode()
        self._lora_ids = {name: index for index, name in enumerate(adapters, start=1)}
        self._encoder = msgspec.msgpack.Encoder()
        self._pending: list[KVCacheEvent] = []
        self.sequence = 0  # of the next batch

    # --- the prefix cache's side ----------------------------------------------------------------

    def stored(
        self,
        hashes: list[int],
        parent: int | None,
        token_ids: list[int],
        block_size: int,
        adapter: str | None,
    ) -> None:
        lora_id = self._lora_ids.get(adapter) if adapter else None
        parent = None if parent is None else parent & HASH_MASK
        blocks = [value & HASH_MASK for value in hashes]
        self._add(BlockStored(blocks, parent, token_ids, block_size, lora_id, MEDIUM, adapter))

    def removed(self, hashes: list[int]) -> None:
        self._add(BlockRemoved([value & HASH_MASK for value in hashes], MEDIUM))

    def cleared(self) -> None:
        self._add(AllBlocksCleared())

    # --- sending --------------------------------------------------------------------------------

    def _add(self, event: KVCacheEvent) -> None:
        self._pending.append(event)
        if len(self._pending) > 1:
            return  # a flush is already scheduled
        try:
            asyncio.get_running_loop().call_soon(self.flush)
        except RuntimeError:  # no loop: nothing batches them
            self.flush()

    def flush(self) -> None:
        if not self._pending:
            return
        batch, self._pending = KVEventBatch(time.time(), self._pending), []
        frames = (self._topic, self.sequence.to_bytes(8, "big"), self._encoder.encode(batch))
        # PUB never blocks: beyond the high-water mark a slow subscriber misses batches, which
        # it sees as a gap in the sequence numbers
        self._socket.send_multipart(frames)
        self.sequence += 1

    def close(self) -> None:
        self.flush()
        self._socket.close(linger=0)
