"""KV blocks on demand and preemption, through the scheduler on an in-process shard: a tiny KV
budget forces the newest requests out and back, and every stream still equals transformers'."""

import asyncio

import pytest

from engine.batch import Request, StoppingCriteriaParameters
from engine.config import ServingLimits
from router.client import InProcessClient
from router.sched.allocator import BlockAllocator
from router.sched.prefix_cache import PrefixCache
from router.sched.scheduler import Scheduler
from tests.helpers import reference_fixture, shard_fixture
from tests.test_equivalence import PROMPTS

BLOCK = 16
NEW = 40  # a request grows by 2-3 blocks while it decodes
LIMITS = ServingLimits(
    max_batch_size=4, max_prefill_tokens=256, max_input_tokens=128, max_total_tokens=256
)


shard = shard_fixture(max_batch_size=4, warmup=LIMITS)
expected = reference_fixture(PROMPTS, NEW)


class UpFrontClient(InProcessClient):
    """A shard client that cannot resume (as TGI's shards): the scheduler reserves every block at admission."""

    resumes = False


def serve(shard, allocator, client_type=InProcessClient):
    async def run():
        client = client_type(shard, max_batch_size=4)
        scheduler = Scheduler(client, allocator, LIMITS)
        await scheduler.start()
        try:
            streams = []
            for i, prompt in enumerate(PROMPTS):
                ids = shard.tokenizer(prompt)["input_ids"]
                stopping = StoppingCriteriaParameters(max_new_tokens=NEW, ignore_eos_token=True)
                streams.append(
                    scheduler.submit(
                        Request(i, prompt, stopping_parameters=stopping), len(ids), ids
                    )
                )
            out = [[g.tokens.ids[0] for g in await collect(s)] for s in streams]
        finally:
            await scheduler.stop()
            await client.close()
        return out, scheduler.stats

    return asyncio.run(run())


async def collect(stream):
    return [g async for g in stream]


@pytest.mark.parametrize("allocator", [BlockAllocator, PrefixCache])
def test_a_tiny_kv_budget_preempts_and_every_stream_stays_exact(shard, expected, allocator):
    tokens, stats = serve(shard, allocator(14, BLOCK))  # 13 blocks: one long request needs up to 6
    assert stats.preemptions > 0
    assert tokens == expected
    assert sum(shard.adapter.shapes.unwarmed.values()) == 0


def test_on_demand_admits_more_requests_than_up_front_reservation(shard, expected):
    tokens, up_front = serve(shard, BlockAllocator(14, BLOCK), UpFrontClient)
    _, on_demand = serve(shard, BlockAllocator(14, BLOCK))
    assert tokens == expected and up_front.preemptions == 0
    assert max(on_demand.decode_sizes) > max(up_front.decode_sizes)


def test_grown_blocks_are_checked_at_the_shard(shard):
    from engine.batch import Batch
    from engine.errors import InvalidRequestError
    from engine.kv_cache import slots_for

    ids = shard.tokenizer(PROMPTS[1])[
        "input_ids"
    ]  # under one block: the first Decode needs no new block
    stopping = StoppingCriteriaParameters(max_new_tokens=NEW, ignore_eos_token=True)
    _, cached = shard.prefill(
        Batch(
            90,
            [
                Request(
                    7,
                    PROMPTS[1],
                    stopping_parameters=stopping,
                    blocks=[3],
                    slots=slots_for([3], 0, len(ids), BLOCK),
                )
            ],
        )
    )
    try:
        for grown, match in (
            ({7: [3]}, "in use by request 7"),
            ({8: [4]}, "not in the decoded batches"),
            ({7: [10**6]}, "not in the KV cache's usable blocks"),
        ):
            with pytest.raises(InvalidRequestError, match=match):
                shard.decode([cached], grown)
        while (
            len(shard.batches[90][0].token_ids) <= BLOCK
        ):  # fill the block, then decode without a new one
            _, cached = shard.decode([cached])
        with pytest.raises(InvalidRequestError, match="KV blocks are full"):
            shard.decode([cached])
        shard.decode([cached], {7: [4]})  # given a block, it goes on
    finally:
        shard.clear()
