"""The scheduler confines every failure to the request that caused it, and resumes requests that
were mid-generation when the shards went away (over an in-process tiny Llama shard)."""

import asyncio

import grpc
import pytest

from engine.batch import GrammarType, NextTokenChooserParameters
from router.client import ShardError
from tests.test_router_outage import OutageClient, wait_for
from tests.test_router_scheduler import (  # noqa: F401 - fixtures
    RecordingClient,
    consume,
    expected,
    full_allocator,
    make_request,
    shard,
    warmed,
    with_scheduler,
)


def with_grammar(request, text: str):
    request.parameters = NextTokenChooserParameters(grammar=text, grammar_type=GrammarType.REGEX)
    return request


def test_an_invalid_request_in_a_prefill_batch_fails_alone(shard, warmed, expected):
    lengths, allocator = warmed[2], full_allocator(warmed[1])

    async def body(scheduler, client):
        requests = [
            make_request(0, 10),
            with_grammar(make_request(1, 10), "(unclosed"),
            make_request(2, 10),
        ]
        streams = [scheduler.submit(r, lengths[r.id]) for r in requests]
        results = await asyncio.gather(*(consume(s) for s in streams), return_exceptions=True)
        return results, client.named("prefill")

    results, prefills = asyncio.run(with_scheduler(shard, allocator, body))
    assert results[0] == expected[0][:10] and results[2] == expected[2][:10]
    assert (
        isinstance(results[1], ShardError) and results[1].code == grpc.StatusCode.INVALID_ARGUMENT
    )
    assert "regex" in results[1].message
    assert [p[2] for p in prefills] == [[0, 1, 2], [0], [1], [2]]  # the batch, then one by one
    assert allocator.idle and not shard.batches


class BuggyClient(RecordingClient):
    """A client with a bug that shows on request 7's prefill only (an exception that is no ShardError)."""

    async def prefill(self, batch, cached=None, **kwargs):
        if any(r.id == 7 for r in batch.requests):
            raise KeyError("a bug in the client")
        return await super().prefill(batch, cached, **kwargs)


def test_an_unexpected_error_in_a_prefill_ends_only_its_new_requests(shard, warmed, expected):
    lengths, allocator = warmed[2], full_allocator(warmed[1])

    async def body(scheduler, client):
        running = scheduler.submit(make_request(0, 20), lengths[0])
        first = await running.__anext__()
        buggy = scheduler.submit(make_request(7, 10, prompt=1), lengths[1])
        with pytest.raises(KeyError):
            await consume(buggy)
        rest = [g async for g in running]
        assert rest[-1].generated_text.generated_tokens == 20
        return first.tokens.ids + [t for g in rest for t in g.tokens.ids]

    assert (
        asyncio.run(with_scheduler(shard, allocator, body, make_client=BuggyClient))
        == expected[0][:20]
    )
    assert allocator.idle and not shard.batches


@pytest.mark.parametrize(
    "field, value", [("top_k", 2**32), ("seed", 2**64), ("temperature", float("inf"))]
)
def test_a_request_the_wire_cannot_carry_is_refused_at_submit(shard, warmed, field, value):
    lengths, allocator = warmed[2], full_allocator(warmed[1])

    async def body(scheduler, client):
        request = make_request(0, 10)
        setattr(request.parameters, field, value)
        with pytest.raises(ValueError, match=field):
            scheduler.submit(request, lengths[0])
        stop = make_request(1, 10)
        stop.stopping_parameters.stop_sequences = ["\ud800"]
        with pytest.raises(ValueError, match="stop"):
            scheduler.submit(stop, lengths[1])
        return scheduler.queue_length, client.calls

    assert asyncio.run(with_scheduler(shard, allocator, body)) == (0, [])


class RestartingClient(OutageClient):
    """The shards die at the `down_at`-th Decode: every RPC fails as a dead socket does until the
    test brings them back."""

    def __init__(self, inner, down_at: int):
        super().__init__(inner)
        self.down_at, self.decode_count = down_at, 0

    async def decode(
        self, batches, *grown, **options
    ):  # grown: KV blocks added on demand; look_ahead
        self.decode_count += 1
        self.down = self.down or self.decode_count == self.down_at
        return await super().decode(batches, *grown, **options)


@pytest.mark.parametrize("down_at", [1, 7])
def test_requests_mid_generation_resume_after_a_restart(shard, warmed, expected, down_at):
    lengths, allocator = warmed[2], full_allocator(warmed[1])

    async def body(scheduler, client):
        streams = [scheduler.submit(make_request(i, 30), lengths[i]) for i in (0, 1)]
        await wait_for(lambda: not scheduler.available)
        client.down = False
        outputs = await asyncio.gather(*(consume(s) for s in streams))
        return outputs, client.named("prefill")

    outputs, prefills = asyncio.run(
        with_scheduler(
            shard, allocator, body, make_client=lambda inner: RestartingClient(inner, down_at)
        )
    )
    assert outputs == [expected[0][:30], expected[1][:30]]  # no token twice, none missing
    assert len(prefills) >= 2 and allocator.idle and not shard.batches


def test_a_seeded_sampled_request_resumes_with_the_tokens_it_would_have_drawn(shard, warmed):
    lengths = warmed[2]

    def sampled():
        request = make_request(0, 24)
        request.parameters = NextTokenChooserParameters(do_sample=True, seed=7, temperature=1.3)
        return request

    async def body(scheduler, client):
        return await consume(scheduler.submit(sampled(), lengths[0]))

    async def restarted(scheduler, client):
        stream = scheduler.submit(sampled(), lengths[0])
        await wait_for(lambda: not scheduler.available)
        client.down = False
        return await consume(stream)

    alone = asyncio.run(with_scheduler(shard, full_allocator(warmed[1]), body))
    resumed = asyncio.run(
        with_scheduler(
            shard,
            full_allocator(warmed[1]),
            restarted,
            make_client=lambda inner: RestartingClient(inner, 5),
        )
    )
    assert resumed == alone and len(alone) == 24
