"""Random traffic with shared prefixes, chunked prompts and a small KV budget (preemptions) never
reaches the device at an unwarmed shape, and every request completes."""

import asyncio

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.batch import Request, StoppingCriteriaParameters
from engine.config import ServingLimits
from router.client import InProcessClient
from router.sched.prefix_cache import PrefixCache
from router.sched.scheduler import Scheduler
from tests.helpers import shard_fixture

BUDGET = 32
LIMITS = ServingLimits(
    max_batch_size=4, max_prefill_tokens=BUDGET, max_input_tokens=112, max_total_tokens=160
)
PREFIXES = ["word " * 70, "The moon landing was in 1969 and " * 6]
TRAFFIC = settings(
    max_examples=5, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


shard = shard_fixture(max_batch_size=4, warmup_prompt_logprobs=False, warmup=LIMITS)


def traffic(data):
    """Waves of requests: a shared prefix cut at a random length, then a random tail."""
    waves = []
    for _ in range(data.draw(st.integers(1, 3), label="waves")):
        wave = []
        for _ in range(data.draw(st.integers(1, 4), label="requests")):
            prefix = data.draw(st.sampled_from(PREFIXES), label="prefix")
            cut = data.draw(st.integers(1, len(prefix)), label="cut")
            tail = data.draw(st.text("abcdefgh ", min_size=1, max_size=30), label="tail")
            wave.append((prefix[:cut] + tail, data.draw(st.integers(1, 24), label="new")))
        waves.append(wave)
    return waves


@pytest.mark.slow
@TRAFFIC
@given(data=st.data())
def test_shared_prefix_and_chunked_traffic_meets_only_warmed_shapes(shard, data):
    waves, blocks = traffic(data), data.draw(st.integers(12, 30), label="router blocks")

    async def run():
        client = InProcessClient(shard, max_batch_size=4)
        scheduler = Scheduler(client, PrefixCache(blocks, 16), LIMITS, chunking=True)
        await scheduler.start()
        done, next_id = [], 0
        try:
            for wave in waves:
                streams = []
                for text, new in wave:
                    ids = shard.tokenizer(text)["input_ids"][-LIMITS.max_input_tokens :]
                    request = Request(
                        next_id,
                        text,
                        truncate=len(ids),
                        stopping_parameters=StoppingCriteriaParameters(new, ignore_eos_token=True),
                    )
                    streams.append((new, scheduler.submit(request, len(ids), ids)))
                    next_id += 1
                for new, stream in streams:
                    done.append(
                        ([g async for g in stream][-1].generated_text.generated_tokens, new)
                    )
        finally:
            await scheduler.stop()
            await client.close()
        return done

    done = asyncio.run(run())
    assert all(count == new for count, new in done)
    assert sum(shard.adapter.shapes.unwarmed.values()) == 0, shard.adapter.shapes.unwarmed
