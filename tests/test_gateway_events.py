"""KV-cache events: a ZeroMQ subscriber that knows only vLLM's event schema rebuilds the prefix
cache's findable blocks exactly, through a shared-prefix workload that evicts."""

import asyncio
import random
import threading
import time

import msgspec
import pytest
import zmq

from router.events.kv_events import KvEventPublisher
from router.sched.prefix_cache import PrefixCache

# --- vLLM's schema, written out from vllm/distributed/kv_events.py (the subscriber's side) ---------
MASK = (1 << 64) - 1  # the hashes on the wire are unsigned


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list
    data_parallel_rank: int | None = None


class KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(KVCacheEvent):
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list | None = None


class BlockRemoved(KVCacheEvent):
    block_hashes: list[int]
    medium: str | None


class AllBlocksCleared(KVCacheEvent):
    pass


class KVEventBatch(EventBatch):
    events: list[BlockStored | BlockRemoved | AllBlocksCleared]


def unsigned(value: int) -> int:
    """The signed chain hash an unsigned wire hash was."""
    return value - (1 << 64) if value >= 1 << 63 else value


class Subscriber:
    """A SUB socket on a thread, replaying every batch into {hash: (parent, tokens, lora_name)}."""

    def __init__(self, endpoint: str, topic: bytes = b""):
        self.socket = zmq.Context.instance().socket(zmq.SUB)
        self.socket.setsockopt(zmq.SUBSCRIBE, topic)
        self.socket.connect(endpoint)
        self.decoder = msgspec.msgpack.Decoder(KVEventBatch)
        self.blocks: dict[int, tuple] = {}
        self.ever: set[int] = set()  # every hash once stored
        self.sequences: list[int] = []
        self.topics: set[bytes] = set()
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.socket.poll(20):
                continue
            topic, sequence, payload = self.socket.recv_multipart()
            self.topics.add(topic)
            self.sequences.append(int.from_bytes(sequence, "big"))
            for event in self.decoder.decode(payload).events:
                self.apply(event)

    def apply(self, event) -> None:
        if isinstance(event, AllBlocksCleared):
            self.blocks.clear()
        elif isinstance(event, BlockRemoved):
            for value in event.block_hashes:
                if self.blocks.pop(value, None) is None:
                    self.errors.append(f"removed {value}, never stored")
        else:
            size = event.block_size
            if len(event.token_ids) != size * len(event.block_hashes):
                self.errors.append("a BlockStored whose tokens are not its blocks'")
            parent = event.parent_block_hash
            for index, value in enumerate(event.block_hashes):
                tokens = tuple(event.token_ids[index * size : (index + 1) * size])
                self.blocks[value] = (parent, tokens, event.lora_name)
                self.ever.add(value)
                parent = value

    def wait_for(self, sequence: int, timeout: float = 10) -> None:
        deadline = time.monotonic() + timeout
        while (not self.sequences or self.sequences[-1] < sequence) and time.monotonic() < deadline:
            time.sleep(0.01)

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self.socket.close(linger=0)


def connected(cache: PrefixCache, publisher: KvEventPublisher, subscriber: Subscriber) -> None:
    """PUB drops what it sends before a subscription arrives: listen (which starts with
    AllBlocksCleared, harmless to repeat) until the subscriber hears it."""
    deadline = time.monotonic() + 10
    while not subscriber.sequences:
        assert time.monotonic() < deadline, "the subscriber never heard the publisher"
        cache.listen(publisher)
        time.sleep(0.05)


def shared_prefix_workload(cache: PrefixCache, seed: int, adapters=(None,)) -> None:
    """Prompts from a few long shared prefixes and random tails, some held while others run, so
    that the 24-block cache evicts."""
    rng = random.Random(seed)
    prefixes = [[rng.randrange(1000) for _ in range(rng.randrange(8, 20))] for _ in range(4)]
    held = []
    for _ in range(60):
        prompt = rng.choice(prefixes) + [rng.randrange(1000) for _ in range(rng.randrange(1, 12))]
        adapter = rng.choice(adapters)
        total = len(prompt) + rng.randrange(1, 6)
        if not cache.can_allocate(total):
            cache.free(held.pop(0)[0])
        allocation = cache.allocate(total, prompt, adapter)
        generated = prompt + [rng.randrange(1000) for _ in range(total - len(prompt))]
        cache.register(allocation, generated, adapter)
        held.append((allocation, generated))
        if len(held) > 2 or rng.random() < 0.5:
            cache.free(held.pop(0)[0])


@pytest.mark.parametrize("adapters", [(None,), (None, "alpha", "beta")])
def test_the_subscriber_rebuilds_the_prefix_cache(adapters):
    cache = PrefixCache(25, 4)
    publisher = KvEventPublisher("tcp://127.0.0.1:*", "kv@test", ("alpha", "beta"))
    subscriber = Subscriber(publisher.endpoint, b"kv@")
    try:
        connected(cache, publisher, subscriber)
        first = subscriber.sequences[0]
        shared_prefix_workload(cache, seed=7, adapters=adapters)
        publisher.flush()
        subscriber.wait_for(publisher.sequence - 1)
        assert cache.stats.evictions > 10  # the workload did evict
        assert set(subscriber.blocks) == {value & MASK for value in cache.findable()}
        assert subscriber.errors == []
        assert subscriber.topics == {b"kv@test"}
        assert subscriber.sequences == list(range(first, publisher.sequence))  # no gap
        names = {lora for _, _, lora in subscriber.blocks.values()}
        assert names <= set(adapters) and len(names) == len(set(adapters))
        # a block's parent is the block before it: its chain hash continues the parent's
        # (engine.wire.contract.chain_hashes), or starts from the adapter for a first block
        followers = [(v, p, t) for v, (p, t, _) in subscriber.blocks.items() if p is not None]
        assert len(followers) > 10
        assert all(
            hash((unsigned(parent), tokens)) & MASK == value for value, parent, tokens in followers
        )
        assert all(parent in subscriber.ever for _, parent, _ in followers)
        firsts = [(v, t, lora) for v, (p, t, lora) in subscriber.blocks.items() if p is None]
        assert all(
            hash((hash(("bucketserve-kv", lora or "")), t)) & MASK == v for v, t, lora in firsts
        )
    finally:
        subscriber.close()
        publisher.close()


def test_one_event_loop_turn_is_one_batch():
    """A step's registrations and evictions go out together, as vLLM batches a step's events."""
    cache = PrefixCache(25, 4)
    publisher = KvEventPublisher("tcp://127.0.0.1:*")
    subscriber = Subscriber(publisher.endpoint)
    try:
        connected(cache, publisher, subscriber)
        before = publisher.sequence

        async def step():
            shared_prefix_workload(cache, seed=3)
            await asyncio.sleep(0)

        asyncio.run(step())
        subscriber.wait_for(before)
        assert publisher.sequence == before + 1
        assert set(subscriber.blocks) == {value & MASK for value in cache.findable()}
    finally:
        subscriber.close()
        publisher.close()


class Recorder:
    """The listener face, replayed as the subscriber does: the hashes a consumer holds."""

    def __init__(self):
        self.blocks: set[int] = set()
        self.log: list[tuple[str, list[int]]] = []

    def stored(self, hashes, parent_hash, token_ids, block_size, adapter) -> None:
        self.blocks |= set(hashes)
        self.log.append(("stored", list(hashes)))

    def removed(self, hashes) -> None:
        self.blocks -= set(hashes)
        self.log.append(("removed", list(hashes)))

    def cleared(self) -> None:
        self.blocks.clear()


def test_blocks_are_announced_when_allocated_and_withdrawn_if_never_computed():
    """As vLLM's scheduler does, BlockStored leaves at allocation, before the prefill: a fleet
    router can send the prompt's siblings here while it is still queued. A request freed before
    its prefill (cancelled, preempted, failed) takes the announcement back."""
    cache, heard = PrefixCache(16, 4), Recorder()
    cache.listen(heard)
    prompt = list(range(10))  # two full blocks
    running = cache.allocate(12, prompt, None)
    assert len(heard.blocks) == 2 and not cache.findable()  # told, not yet findable here
    assert cache.allocate(12, prompt, None).cache_len == 0  # a sibling cannot reuse it yet
    cache.register(running, prompt, None)
    assert heard.blocks == cache.findable() and len(heard.log) == 1  # not told twice
    cancelled = cache.allocate(12, [99] + prompt[1:], None)
    assert len(heard.blocks) == 4
    cache.free(cancelled)
    assert heard.blocks == cache.findable() and heard.log[-1][0] == "removed"


@pytest.mark.parametrize("seed", range(8))
def test_announced_blocks_add_up_to_the_findable_ones_whatever_the_order(seed):
    """Requests of shared prefixes allocated together, computed in any order or freed before
    their prefill: once all are done, the events add up to exactly what is findable."""
    rng = random.Random(seed)
    cache, heard = PrefixCache(40, 4), Recorder()
    cache.listen(heard)
    prefixes = [[rng.randrange(500) for _ in range(rng.randrange(4, 14))] for _ in range(3)]
    pending, done = [], []
    for _ in range(80):
        if pending and (rng.random() < 0.4 or not cache.can_allocate(24)):
            allocation, prompt = pending.pop(rng.randrange(len(pending)))
            if rng.random() < 0.25:
                cache.free(allocation)  # never computed
            else:
                cache.register(allocation, prompt, None)
                done.append(allocation)
        elif done and rng.random() < 0.3:
            cache.free(done.pop(rng.randrange(len(done))))
        elif cache.can_allocate(24):
            prompt = rng.choice(prefixes) + [rng.randrange(500) for _ in range(rng.randrange(6))]
            pending.append((cache.allocate(len(prompt) + 4, prompt, None), prompt))
        if not pending:  # nothing in flight: nothing announced that is not findable
            assert heard.blocks == cache.findable()
    for allocation, _ in pending:
        cache.free(allocation)
    for allocation in done:
        cache.free(allocation)
    assert heard.blocks == cache.findable()
