"""The router's prefix cache: hash chain, reference counts, LRU eviction, and exact tokens through
the scheduler on an in-process shard (caching on equals caching off equals transformers)."""

import asyncio

import pytest

from engine.batch import Request, StoppingCriteriaParameters
from engine.config import ServingLimits
from router.client import InProcessClient
from router.sched.allocator import BlockAllocator
from router.sched.prefix_cache import PrefixCache
from router.sched.scheduler import Scheduler
from tests.helpers import build_request, reference_fixture, shard_fixture

BLOCK = 16
NEW = 5
SYSTEM = (
    "You are a careful assistant. Answer briefly and truthfully, cite no sources, and never invent facts "
    "about the moon landing or anything else. "
)
QUESTIONS = [
    "Who flew Apollo 11?",
    "When was it?",
    "Hi",
    "What did they bring back from the Sea of Tranquility?",
]
PROMPTS = [SYSTEM + q for q in QUESTIONS] + [SYSTEM[:40] + "Unrelated.", SYSTEM[:70]]


def test_hash_chain_refcounts_and_lru_eviction():
    cache = PrefixCache(num_blocks=8, block_size=4)  # 7 usable blocks
    first = cache.allocate(9, list(range(9)))  # 3 blocks, nothing cached yet
    assert first.cache_len == 0
    cache.register(first, list(range(9)), None)  # its first 2 blocks are full
    again = cache.allocate(9, list(range(9)))  # shares 2 blocks while the first still runs
    assert again.cache_len == 8 and again.blocks[:2] == first.blocks[:2] and cache.num_used == 4
    five = cache.allocate(5, list(range(5)))  # one block: the last token is always computed
    assert five.cache_len == 4 and five.blocks[0] == first.blocks[0]
    other_adapter = cache.allocate(1, list(range(9)), "lora")
    assert other_adapter.cache_len == 0  # the adapter is in the chain
    for allocation in (other_adapter, again, first):
        cache.free(allocation)
    assert (
        cache.num_cached == 2 and cache.num_free == 5
    )  # block 2 is cached and evictable, block 1 in use
    cache.allocate(
        20, list(range(100, 120))
    )  # 5 blocks: the 4 never cached, then the cached unused one
    assert cache.stats.evictions == 1 and cache.num_cached == 1
    with pytest.raises(Exception, match="KV cache full"):
        cache.allocate(8, list(range(8)))  # reuses block 1 but finds no other
    assert cache.stats.hit_requests == 2 and cache.stats.hit_tokens == 12


shard = shard_fixture(
    max_batch_size=4,
    warmup=ServingLimits(
        max_batch_size=4, max_prefill_tokens=256, max_input_tokens=64 * 2, max_total_tokens=256
    ),
)
expected = reference_fixture(PROMPTS, NEW)


def serve(shard, allocator, waves):
    """Each wave's requests are submitted together after the previous wave finished."""

    async def run():
        client = InProcessClient(shard, max_batch_size=4)
        limits = ServingLimits(
            max_batch_size=4, max_prefill_tokens=256, max_input_tokens=128, max_total_tokens=256
        )
        scheduler = Scheduler(client, allocator, limits)
        await scheduler.start()
        out = {}
        try:
            for wave in waves:
                streams = {i: scheduler.submit(request(shard, i), *ids_of(shard, i)) for i in wave}
                for i, stream in streams.items():
                    out[i] = [g.tokens.ids[0] async for g in stream]
        finally:
            await scheduler.stop()
            await client.close()
        return out

    return asyncio.run(run())


def ids_of(shard, i):
    ids = shard.tokenizer(PROMPTS[i])["input_ids"]
    return len(ids), ids


def request(shard, i):
    return build_request(i, NEW, PROMPTS[i])


def test_shared_prefixes_equal_transformers_and_caching_off(shard, expected):
    blocks = shard.runner.kv_cache.num_blocks
    waves = [
        [0],
        [1, 2, 3],
        [4, 5],
    ]  # then the same system prompt concurrently; then partial-block prefixes
    cache = PrefixCache(blocks, BLOCK)
    before = shard.runner.padding.real("prefill")
    cached = serve(shard, cache, waves)
    computed_cached = shard.runner.padding.real("prefill") - before
    plain = serve(shard, BlockAllocator(blocks, BLOCK), waves)
    computed_plain = shard.runner.padding.real("prefill") - before - computed_cached
    assert cached == plain
    assert [cached[i] for i in range(len(PROMPTS))] == expected
    system_blocks = len(shard.tokenizer(SYSTEM)["input_ids"]) // BLOCK
    assert (
        cache.stats.hit_requests >= 3 and cache.stats.hit_tokens >= 3 * (system_blocks - 1) * BLOCK
    )
    assert (
        computed_plain - computed_cached == cache.stats.hit_tokens
    )  # the shard computed only the rest
    assert sum(shard.adapter.shapes.unwarmed.values()) == 0


@pytest.mark.parametrize("setting", ["on", "off"])
def test_the_launcher_passes_prefix_caching_to_the_shards_and_the_router(setting):
    from engine.cli.main import build_parser as engine_parser
    from engine.cli.main import engine_config
    from launcher.cli import build_parser, config_from_args
    from router.app import build_parser as router_parser
    from router.app import config_from_args as router_config

    config = config_from_args(build_parser().parse_args(["--prefix-caching", setting]))
    shard = engine_config(engine_parser().parse_args(["serve", *config.shard_args()]))
    router = router_parser().parse_args(config.router_args())
    assert shard.prefix_caching == router_config(router).prefix_caching == (setting == "on")


def test_a_group_that_does_not_fit_waits_without_allocating_or_counting_lookups():
    """n=3 siblings of a 9-token prompt whose 2 first blocks are cached: each needs 1 block of its own
    now. Checking a group that does not fit takes no block and counts no lookup (it used to allocate
    member by member, free them again, and count every lookup on each scheduler pass)."""
    from router.sched import batching, kv_blocks
    from router.sched.streams import Entry

    cache = PrefixCache(num_blocks=9, block_size=4)  # 8 usable blocks
    prompt = list(range(9))
    cached = cache.allocate(9, prompt)
    cache.register(cached, prompt, None)
    cache.free(cached)
    group = [
        Entry(
            Request(i, "x", stopping_parameters=StoppingCriteriaParameters(4)), 9, token_ids=prompt
        )
        for i in range(3)
    ]
    blocker = cache.allocate(16)  # 4 of the 6 uncached blocks: 2 left for 3 members
    lookups, free = cache.stats.requests, cache.num_free
    assert not kv_blocks.group_fits(cache, group, longest_prefill=64)
    assert not batching._allocate(cache, group, 64)  # what each scheduler pass asks
    assert (cache.stats.requests, cache.num_free) == (lookups, free)
    cache.free(blocker)
    assert kv_blocks.group_fits(cache, group, longest_prefill=64)
    allocations = [kv_blocks.admit(cache, entry, 64) for entry in group]
    assert all(a.cache_len == 8 for a in allocations) and cache.stats.requests == lookups + 3


def test_the_plain_allocator_checks_copies_too():
    allocator = BlockAllocator(num_blocks=9, block_size=4)
    assert allocator.fits(9, copies=2) and not allocator.fits(9, copies=3)
