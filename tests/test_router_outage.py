"""The scheduler when the shards go away (a restart) and when too many requests arrive: requests
that had not started are held and served once the shards are back; nothing is lost or leaked."""

import asyncio
import os
from dataclasses import replace

import grpc
import pytest

from router.app import watch_parent
from router.client import ShardError
from router.sched.scheduler import Overloaded, ShardsUnavailable
from tests.test_router_scheduler import (  # noqa: F401 - fixtures
    LIMITS,
    RecordingClient,
    consume,
    expected,
    full_allocator,
    make_request,
    shard,
    warmed,
    with_scheduler,
)


class OutageClient(RecordingClient):
    """A real in-process shard behind a switch: while `down`, every RPC fails as a dead socket does."""

    def __init__(self, inner, capacity_after_restart: int | None = None):
        super().__init__(inner)
        self.down, self.health_checks, self.rewarms = False, 0, 0
        self.capacity_after_restart = capacity_after_restart

    def _check(self):
        if self.down:
            raise ShardError(grpc.StatusCode.UNAVAILABLE, "connection refused")

    async def prefill(self, batch, cached=None, **resume):
        self._check()
        return await super().prefill(batch, cached, **resume)

    async def decode(
        self, batches, *grown, **options
    ):  # grown: KV blocks added on demand; look_ahead
        self._check()
        return await super().decode(batches, *grown, **options)

    async def clear_cache(self, batch_id=None):
        self._check()
        await super().clear_cache(batch_id)

    async def health(self):
        self.health_checks += 1
        self._check()

    async def rewarm(self):
        self.rewarms += 1
        await self.inner.clear_cache(None)  # a restarted shard has no batches
        return self.capacity_after_restart


def run(shard, allocator, body, limits=LIMITS, capacity_after_restart=None):
    return with_scheduler(
        shard,
        allocator,
        body,
        limits=limits,
        make_client=lambda inner: OutageClient(inner, capacity_after_restart),
    )


async def wait_for(condition, timeout: float = 30):
    deadline = asyncio.get_running_loop().time() + timeout
    while not condition():
        assert asyncio.get_running_loop().time() < deadline, "condition never held"
        await asyncio.sleep(0.01)


def test_requests_that_had_not_started_are_held_through_an_outage(shard, warmed, expected):
    lengths, allocator = warmed[2], full_allocator(warmed[1])

    async def body(scheduler, client):
        client.down = True
        held = [scheduler.submit(make_request(i, 10), lengths[i]) for i in (0, 1)]
        await wait_for(lambda: not scheduler.available)  # their prefill met the dead shard
        with pytest.raises(ShardsUnavailable):
            scheduler.submit(make_request(2, 10), lengths[2])
        assert scheduler.queue_length == 2 and allocator.idle  # held without blocks
        await wait_for(lambda: client.health_checks >= 2)  # it keeps asking
        client.down = False
        outputs = await asyncio.gather(*(consume(s) for s in held))
        return outputs, client.rewarms, scheduler.available, scheduler.allocator

    # The restarted shard has half the KV capacity: the router's allocator follows it.
    smaller = warmed[1] // 2
    outputs, rewarms, available, resized = asyncio.run(
        run(shard, allocator, body, capacity_after_restart=smaller)
    )
    assert outputs == [expected[0][:10], expected[1][:10]]
    assert rewarms == 1 and available
    assert resized.num_blocks == smaller // 16 + 1 != allocator.num_blocks
    assert resized.idle and allocator.idle and not shard.batches


class TgiShardClient(OutageClient):
    """Shards that cannot resume a request (TGI's do not read the generated tokens)."""

    resumes = False


def test_behind_shards_that_cannot_resume_running_requests_fail_in_an_outage(
    shard, warmed, expected
):
    """Our shards resume them (test_reliability_scheduler.py); others cannot, so they fail."""
    lengths, allocator = warmed[2], full_allocator(warmed[1])

    async def body(scheduler, client):
        running = scheduler.submit(make_request(0, 30), lengths[0])
        first = await running.__anext__()  # it is in the shard's batch now
        client.down = True
        with pytest.raises(ShardError, match="UNAVAILABLE"):
            async for _ in running:
                pass
        await wait_for(lambda: not scheduler.available)
        client.down = False
        await wait_for(lambda: scheduler.available)
        later = await consume(scheduler.submit(make_request(3, 10), lengths[3]))
        return first, later

    first, later = asyncio.run(with_scheduler(shard, allocator, body, make_client=TgiShardClient))
    assert first.tokens.ids == expected[0][:1]
    assert later == expected[3][:10]
    assert allocator.idle


class Server:
    should_exit = False  # what watch_parent sets on uvicorn's server


def test_when_the_launcher_is_gone_held_requests_end_unavailable_and_the_server_exits(
    shard, warmed
):
    """Nothing will restart the shards: a held request that waited for them would keep the router
    (and its balancer's connection) alive forever. It ends with a 503, which a balancer retries."""
    lengths, allocator = warmed[2], full_allocator(warmed[1])
    not_our_parent = os.getppid() + 1  # watch_parent sees a new parent at once

    async def body(scheduler, client):
        client.down = True
        held = [scheduler.submit(make_request(i, 10), lengths[i]) for i in (0, 1)]
        await wait_for(lambda: not scheduler.available)
        server = Server()
        await asyncio.wait_for(watch_parent(not_our_parent, server, scheduler), 10)
        ends = await asyncio.wait_for(
            asyncio.gather(*(consume(s) for s in held), return_exceptions=True), 10
        )

        with pytest.raises(ShardsUnavailable, match="stopping"):  # nothing left to serve it
            scheduler.submit(make_request(2, 10), lengths[2])
        return ends, server.should_exit

    ends, exiting = asyncio.run(run(shard, allocator, body))
    assert [type(e) for e in ends] == [ShardsUnavailable, ShardsUnavailable], ends
    assert exiting and allocator.idle


def test_beyond_max_concurrent_requests_a_submit_is_overloaded(shard, warmed, expected):
    lengths, allocator = warmed[2], full_allocator(warmed[1])
    limits = replace(LIMITS, max_concurrent_requests=2)

    async def body(scheduler, client):
        streams = [scheduler.submit(make_request(i, 10), lengths[i]) for i in (0, 1)]
        with pytest.raises(Overloaded):
            scheduler.submit(make_request(2, 10), lengths[2])
        outputs = await asyncio.gather(*(consume(s) for s in streams))
        # Once they are done there is room again.
        return outputs, await consume(scheduler.submit(make_request(2, 10), lengths[2]))

    outputs, third = asyncio.run(run(shard, allocator, body, limits))
    assert outputs == [expected[0][:10], expected[1][:10]] and third == expected[2][:10]
    assert allocator.idle
