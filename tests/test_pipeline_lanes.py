"""The router's pipeline lanes (router/sched/lanes.py): shards of two stages get two batches in
flight, each lane sending its steps without waiting for the other's answers; tokens, cancellation,
an outage and KV blocks stay as with one batch. The shard is the in-process tiny Llama, behind a
client that says it has two stages."""

import asyncio

from router.sched.lanes import Lanes
from tests.test_router_outage import OutageClient, wait_for
from tests.test_router_scheduler import (  # noqa: F401 - fixtures
    LIMITS,
    consume,
    expected,
    full_allocator,
    make_request,
    shard,
    warmed,
    with_scheduler,
)

STEP_S = 0.005  # a pipeline step takes a while: meanwhile the other lane may send its own


class TwoStageClient(OutageClient):
    """Counts the steps in flight at once; `pipeline_stages` as a client learns it from Info."""

    def __init__(self, inner, stages: int = 2):
        super().__init__(inner)
        self.pipeline_stages = stages
        self.in_flight, self.most_in_flight = 0, 0

    async def _step(self, call):
        self.in_flight += 1
        self.most_in_flight = max(self.most_in_flight, self.in_flight)
        try:
            await asyncio.sleep(STEP_S)
            return await call
        finally:
            self.in_flight -= 1

    async def prefill(self, batch, cached=None, **resume):
        return await self._step(super().prefill(batch, cached, **resume))

    async def decode(self, batches, *grown, **options):
        if self.pipeline_stages > 1:
            assert not options.get("look_ahead"), "the lanes replace decode lookahead"
        return await self._step(super().decode(batches, *grown, **options))


def run(shard, allocator, body, stages: int = 2):
    return with_scheduler(
        shard, allocator, body, make_client=lambda inner: TwoStageClient(inner, stages)
    )


def test_two_stages_get_two_batches_in_flight_with_the_reference_tokens(shard, warmed, expected):
    lengths, allocator = [12, 20, 8, 16, 5, 10], full_allocator(warmed[1])

    async def body(scheduler, client):
        assert isinstance(scheduler._lanes, Lanes)
        streams = [
            scheduler.submit(make_request(i, n), warmed[2][i]) for i, n in enumerate(lengths)
        ]
        return await asyncio.gather(*(consume(s) for s in streams)), client

    results, client = asyncio.run(run(shard, allocator, body))
    for i, (tokens, n) in enumerate(zip(results, lengths)):
        assert tokens == expected[i][:n], f"request {i}"
    assert client.most_in_flight == 2
    decoded = {tuple(c[1]) for c in client.named("decode")}
    assert len({ids[0] for ids in decoded}) >= 2  # two batches of their own
    assert allocator.idle and not shard.batches


def test_with_one_stage_one_step_is_in_flight(shard, warmed, expected):
    allocator = full_allocator(warmed[1])

    async def body(scheduler, client):
        assert scheduler._lanes is None
        streams = [scheduler.submit(make_request(i, 8), warmed[2][i]) for i in range(4)]
        return await asyncio.gather(*(consume(s) for s in streams)), client

    results, client = asyncio.run(run(shard, allocator, body, stages=1))
    assert results == [expected[i][:8] for i in range(4)]
    assert client.most_in_flight == 1


def test_a_cancelled_request_leaves_its_lane_and_the_others_finish(shard, warmed, expected):
    allocator = full_allocator(warmed[1])

    async def body(scheduler, client):
        others = [
            asyncio.ensure_future(consume(scheduler.submit(make_request(i, 20), warmed[2][i])))
            for i in (0, 1, 2)
        ]
        stream = scheduler.submit(make_request(3, 25), warmed[2][3])
        got = []
        async for generation in stream:
            got.extend(generation.tokens.ids)
            if len(got) == 3:
                break
        await stream.aclose()
        return await asyncio.gather(*others), got, client

    outputs, got, client = asyncio.run(run(shard, allocator, body))
    assert outputs == [expected[i][:20] for i in (0, 1, 2)] and got == expected[3][:3]
    assert client.named("filter") or client.named("clear")  # its lane dropped it on the shard
    assert allocator.idle and not shard.batches


def test_an_outage_holds_every_lane_and_their_requests_resume(shard, warmed, expected):
    allocator = full_allocator(warmed[1])

    async def body(scheduler, client):
        streams = [scheduler.submit(make_request(i, 24), warmed[2][i]) for i in range(6)]
        tasks = [asyncio.ensure_future(consume(s)) for s in streams]
        await wait_for(lambda: client.most_in_flight == 2 and len(client.named("decode")) > 4)
        client.down = True
        await wait_for(lambda: not scheduler.available)
        await wait_for(lambda: client.health_checks >= 2)
        client.down = False
        return await asyncio.gather(*tasks), client.rewarms

    outputs, rewarms = asyncio.run(run(shard, allocator, body))
    assert outputs == [expected[i][:24] for i in range(6)]  # resumed where they stopped
    assert rewarms == 1
    assert allocator.idle and not shard.batches
