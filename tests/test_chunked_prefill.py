"""Chunked prefill: a prompt of 4x the prefill budget is computed in chunks next to a running
decode, and its tokens equal transformers'."""

import asyncio

import pytest

from engine.batch import Batch, Request, StoppingCriteriaParameters
from engine.config import ServingLimits
from engine.errors import InvalidRequestError
from router.client import InProcessClient
from router.http.metrics import RouterMetrics
from router.sched.prefix_cache import PrefixCache
from router.sched.scheduler import Scheduler
from tests.helpers import reference_fixture, shard_fixture
from tests.test_equivalence import PROMPTS

BUDGET = 32
LONG = " ".join([PROMPTS[4]] * 3)  # about 4.5x the budget
SHORT = PROMPTS[1]
NEW = 8
LIMITS = ServingLimits(
    max_batch_size=4, max_prefill_tokens=BUDGET, max_input_tokens=192, max_total_tokens=256
)


shard = shard_fixture(max_batch_size=4, warmup=LIMITS)
expected = reference_fixture([LONG, SHORT], NEW)


def test_the_shard_chunks_a_prompt_beyond_its_budget(shard):
    info = shard.info()
    assert (
        info.support_chunking
        and shard.limits.max_prefill_tokens == BUDGET < shard.limits.max_input_tokens
    )
    assert (
        shard.runner.plan.max_prefill_seq_len <= BUDGET
    )  # no prefill graph of the long prompt's length
    assert len(shard.tokenizer(LONG)["input_ids"]) >= 4 * BUDGET


def test_a_long_prompt_in_chunks_next_to_decodes_equals_transformers(shard, expected):
    arrivals = []

    async def run():
        client = InProcessClient(shard, max_batch_size=4)
        scheduler = Scheduler(
            client, PrefixCache(shard.runner.kv_cache.num_blocks, 16), LIMITS, chunking=True
        )
        metrics = RouterMetrics(scheduler, client)
        await scheduler.start()
        try:
            streams = []
            for i, text in enumerate([LONG, SHORT]):
                ids = shard.tokenizer(text)["input_ids"]
                stopping = StoppingCriteriaParameters(max_new_tokens=NEW, ignore_eos_token=True)
                streams.append(
                    scheduler.submit(Request(i, text, stopping_parameters=stopping), len(ids), ids)
                )
            out = await asyncio.gather(*(collect(s, i, arrivals) for i, s in enumerate(streams)))
        finally:
            await scheduler.stop()
            await client.close()
        return out, scheduler.stats, metrics.render().decode()

    before = shard.serving_stats()["prefill_chunks"]
    tokens, stats, scraped = asyncio.run(run())
    assert tokens == expected
    assert stats.chunked_prompts == 1
    assert shard.serving_stats()["prefill_chunks"] - before >= 4  # 4.5 budgets: at least 4 chunks
    for line in (
        "bucketserve_chunked_admissions_total 1.0",
        "bucketserve_prefix_cache_lookups_total 2.0",
        "bucketserve_preemptions_total 0.0",
        "bucketserve_prefix_cache_hit_rate_tokens 0.0",
    ):
        assert line in scraped
    assert (
        arrivals.index(0) >= 2
    )  # the short request decoded while the long one was still in chunks
    assert sum(shard.adapter.shapes.unwarmed.values()) == 0


async def collect(stream, i, arrivals):
    out = []
    async for generation in stream:
        arrivals.append(i)
        out.append(generation.tokens.ids[0])
    return out


def test_bad_chunk_len_and_chunked_prompt_logprobs_are_invalid(shard):
    for bad, match in (
        (dict(chunk_len=0), "a chunk computes at least one token"),
        (dict(prefill_logprobs=True), "prefill_logprobs needs the whole prompt"),
    ):
        with pytest.raises(InvalidRequestError, match=match):
            shard.prefill(Batch(70, [Request(1, LONG, **bad)]))
    assert not shard.batches


def test_a_chunk_continues_a_context_that_ends_inside_a_block(shard, expected, monkeypatch):
    """A router's first chunk_len need not be whole blocks (the budget left): the next chunk's context
    then ends mid-block, and still runs at its bucket's exact shape."""
    from engine.kv_cache import slots_for

    tensors, widths = shard.runner._prefill_tensors, []

    def checked(bucket, seqs):
        out = tensors(bucket, seqs)
        if out[2].context_slots is not None:
            widths.append((out[2].context_slots.shape[1], bucket.context_blocks * 16))
        return out

    monkeypatch.setattr(shard.runner, "_prefill_tensors", checked)

    ids = shard.tokenizer(LONG)["input_ids"]
    blocks = list(range(1, 2 + (len(ids) + NEW) // 16))
    stopping = StoppingCriteriaParameters(max_new_tokens=NEW, ignore_eos_token=True)
    request = Request(
        0,
        LONG,
        stopping_parameters=stopping,
        blocks=blocks,
        slots=slots_for(blocks, 0, len(ids), 16),
        chunk_len=BUDGET - 1,
    )
    tokens, (generations, cached) = [], shard.prefill(Batch(80, [request]))
    while True:
        tokens += [g.tokens.ids[0] for g in generations]
        if cached is None:
            break
        generations, cached = shard.decode([cached])
    assert tokens == expected[0]
    assert len(widths) >= 4 and all(width == planned for width, planned in widths)
