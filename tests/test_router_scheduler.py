"""The router's continuous-batching scheduler over an in-process tiny Llama shard."""

import asyncio

import grpc
import pytest

from engine.batch import Batch, Request, StoppingCriteriaParameters
from engine.config import ServingLimits
from router.client import InProcessClient, ShardError
from router.sched.allocator import BlockAllocator
from router.sched.scheduler import Scheduler
from tests.helpers import build_request, reference_fixture, tiny_shard
from tests.test_equivalence import PROMPTS

LIMITS = ServingLimits(
    max_batch_size=4, max_prefill_tokens=128, max_input_tokens=64, max_total_tokens=128
)
MAX_NEW = 30


@pytest.fixture(scope="module")
def warmed(tiny_model_dirs):
    """(shard, KV capacity in tokens, tokenizer-counted prompt lengths), warmed once for the module."""
    shard = tiny_shard(tiny_model_dirs["llama"], warmup=False, max_batch_size=4)

    async def warm():
        client = InProcessClient(shard, max_batch_size=LIMITS.max_batch_size)
        try:
            warmup = Batch(
                0,
                [Request(0, "_test " * 8, stopping_parameters=StoppingCriteriaParameters(4))],
                size=1,
            )
            return await client.warmup(
                warmup, LIMITS.max_input_tokens, LIMITS.max_prefill_tokens, LIMITS.max_total_tokens
            )
        finally:
            await client.close()

    result = asyncio.run(warm())
    lengths = [len(shard.tokenizer(p)["input_ids"]) for p in PROMPTS]
    return shard, result.max_supported_total_tokens, lengths


expected = reference_fixture(PROMPTS, MAX_NEW)


@pytest.fixture
def shard(warmed):
    shard = warmed[0]
    shard.clear()  # a failed test must not leave batches behind for the next one
    yield shard
    shard.clear()


class RecordingClient:
    """Passes every call to the real client and records it; can fail one Decode on purpose."""

    def __init__(self, inner, fail_decode_at: int | None = None):
        self.inner, self.fail_decode_at = inner, fail_decode_at
        self.calls: list[tuple] = []
        self.decodes = 0

    @property
    def resumes(self) -> bool:
        return self.inner.resumes

    async def prefill(self, batch, cached=None, **resume):
        self.calls.append(("prefill", batch.id, [r.id for r in batch.requests]))
        return await self.inner.prefill(batch, cached, **resume)

    async def decode(
        self, batches, *grown, **options
    ):  # grown: KV blocks added on demand; look_ahead
        self.decodes += 1
        self.calls.append(("decode", [b.id for b in batches], sum(b.size for b in batches)))
        if self.decodes == self.fail_decode_at:
            raise ShardError(grpc.StatusCode.INTERNAL, "injected decode failure")
        return await self.inner.decode(batches, *grown, **options)

    async def filter_batch(self, batch_id, request_ids):
        result = await self.inner.filter_batch(batch_id, request_ids)
        self.calls.append(("filter", batch_id, list(request_ids)))
        return result

    async def clear_cache(self, batch_id=None):
        self.calls.append(("clear", batch_id))
        await self.inner.clear_cache(batch_id)

    def named(self, name):
        return [call for call in self.calls if call[0] == name]


def make_request(i: int, max_new: int, prompt: int | None = None) -> Request:
    return build_request(i, max_new, PROMPTS[i % len(PROMPTS) if prompt is None else prompt])


async def consume(stream) -> list[int]:
    tokens, last = [], None
    async for generation in stream:
        tokens.extend(generation.tokens.ids)
        last = generation
    assert last is not None and last.generated_text is not None
    assert last.generated_text.generated_tokens == len(tokens)
    return tokens


async def with_scheduler(
    shard, allocator, body, fail_decode_at=None, limits=LIMITS, make_client=None
):
    """Run `body(scheduler, client)` against a started scheduler; always stop and close. The client
    wraps the in-process one: a RecordingClient, or `make_client(inner)`; its `rewarm`, if it has
    one, is the scheduler's."""
    inner = InProcessClient(shard, max_batch_size=limits.max_batch_size)
    client = make_client(inner) if make_client else RecordingClient(inner, fail_decode_at)
    scheduler = Scheduler(client, allocator, limits, rewarm=getattr(client, "rewarm", None))
    await scheduler.start()
    try:
        return await body(scheduler, client)
    finally:
        await scheduler.stop()
        await inner.close()


def allocator_blocks(tokens: int) -> int:
    return -(-tokens // 16)


def full_allocator(capacity: int) -> BlockAllocator:
    return BlockAllocator(capacity // 16 + 1, 16)


def test_concurrent_requests_match_reference_and_batch_continuously(shard, warmed, expected):
    lengths = [5, 12, 20, 8, 30, 3, 17, 25, 1, 10]
    allocator = full_allocator(warmed[1])

    async def body(scheduler, client):
        streams = [
            scheduler.submit(make_request(i, n), warmed[2][i % len(PROMPTS)])
            for i, n in enumerate(lengths)
        ]
        return await asyncio.gather(*(consume(s) for s in streams)), client, scheduler

    results, client, scheduler = asyncio.run(with_scheduler(shard, allocator, body))
    for i, (tokens, n) in enumerate(zip(results, lengths)):
        assert tokens == expected[i % len(PROMPTS)][:n], f"request {i}"
    sizes = [len(c[2]) for c in client.named("prefill")] + [c[2] for c in client.named("decode")]
    assert max(sizes) <= LIMITS.max_batch_size
    assert any(size > 1 for size in sizes)  # batching happened
    assert scheduler.stats.prefills_while_running > 0  # continuous batching
    assert any(
        len(c[1]) == 2 for c in client.named("decode")
    )  # a Decode joined running and new batches
    assert max(scheduler.stats.decode_sizes) <= LIMITS.max_batch_size
    assert allocator.idle


def test_kv_pressure_makes_requests_wait(shard, warmed, expected):
    lengths = warmed[2]
    prompts = [0, 1, 2, 3, 5, 1]
    needs = [allocator_blocks(lengths[p] + 20) for p in prompts]
    allocator = BlockAllocator(1 + 2 * max(needs), 16)  # about two requests at a time
    seen_queue = []

    async def body(scheduler, client):
        streams = [
            scheduler.submit(make_request(i, 20, p), lengths[p]) for i, p in enumerate(prompts)
        ]
        tasks = [asyncio.ensure_future(consume(s)) for s in streams]
        while not all(t.done() for t in tasks):
            if scheduler.running_count:
                seen_queue.append(scheduler.queue_length)
            await asyncio.sleep(0.001)
        return [t.result() for t in tasks], scheduler.stats

    results, stats = asyncio.run(with_scheduler(shard, allocator, body))
    for p, tokens in zip(prompts, results):
        assert tokens == expected[p][:20]
    assert max(seen_queue) > 0 and stats.kv_waits > 0
    # Blocks are taken as requests grow (router/sched/preemption.py): more than two decode at once, and
    # the pressure shows as waits at admission and as preemptions when a running request needs a block.
    assert stats.preemptions > 0
    assert allocator.idle


def test_closing_a_stream_cancels_its_request(shard, warmed, expected):
    lengths = warmed[2]
    allocator = full_allocator(warmed[1])

    async def body(scheduler, client):
        others = [scheduler.submit(make_request(i, 25), lengths[i]) for i in (1, 2)]
        others_tasks = [asyncio.ensure_future(consume(s)) for s in others]
        stream = scheduler.submit(make_request(3, MAX_NEW), lengths[3])
        got = []
        async for generation in stream:
            got.extend(generation.tokens.ids)
            if len(got) == 2:
                break
        await stream.aclose()
        while not client.named("filter") and not all(t.done() for t in others_tasks):
            await asyncio.sleep(0.001)
        held = [
            scheduler._entries.get(i) for i in (1, 2)
        ]  # blocks grow on demand: what the others hold now
        used_after_filter = (
            allocator.num_used,
            sum(len(e.allocation.blocks) for e in held if e and e.allocation),
        )
        return got, await asyncio.gather(*others_tasks), used_after_filter, client

    got, results, used_after_filter, client = asyncio.run(with_scheduler(shard, allocator, body))
    assert got == expected[3][:2]
    assert results == [expected[1][:25], expected[2][:25]]
    filters = client.named("filter")
    assert len(filters) == 1 and sorted(filters[0][2]) == [1, 2]
    used, others_blocks = used_after_filter
    assert used == others_blocks  # the cancelled request's blocks were freed at once
    assert allocator.idle


def test_shard_error_fails_its_batch_and_the_loop_carries_on(shard, warmed, expected):
    lengths = warmed[2]
    allocator = full_allocator(warmed[1])

    async def body(scheduler, client):
        first = [scheduler.submit(make_request(i, 10), lengths[i]) for i in (0, 1, 2)]
        outcomes = await asyncio.gather(*(consume(s) for s in first), return_exceptions=True)
        later = [scheduler.submit(make_request(i, 10), lengths[i]) for i in (3, 4)]
        return outcomes, await asyncio.gather(*(consume(s) for s in later)), client, scheduler.stats

    outcomes, later, client, stats = asyncio.run(
        with_scheduler(shard, allocator, body, fail_decode_at=2)
    )
    assert all(isinstance(o, ShardError) and "injected" in o.message for o in outcomes)
    failed_decode = client.named("decode")[1]
    assert [("clear", batch_id) for batch_id in failed_decode[1]] == client.named("clear")
    assert later == [expected[3][:10], expected[4][:10]]
    assert stats.failed_steps == 1
    assert allocator.idle
    assert not shard.batches


def test_requests_that_can_never_fit_are_refused():
    scheduler = Scheduler(None, BlockAllocator(4, 16), LIMITS)  # 3 usable blocks: 48 tokens
    with pytest.raises(ValueError, match="`inputs` tokens must be <="):
        scheduler.submit(make_request(0, 1), 65)
    with pytest.raises(ValueError, match="`inputs` tokens \\+ `max_new_tokens` must be <="):
        scheduler.submit(make_request(0, 100), 40)
    with pytest.raises(ValueError, match="KV blocks"):
        scheduler.submit(make_request(0, 30), 20)  # 50 tokens: 4 blocks
    with pytest.raises(ValueError, match="blocks and slots"):
        scheduler.submit(Request(0, "x", blocks=[1], slots=[16]), 1)
    stream = scheduler.submit(make_request(0, 28), 20)  # 48 tokens: fits exactly
    with pytest.raises(ValueError, match="already in use"):
        scheduler.submit(make_request(0, 1), 1)
    assert scheduler.queue_length == 1
    del stream  # a stream dropped unread cancels its request: it leaves the queue
    assert scheduler.queue_length == 0
