"""One KV-token rule for both sides (engine/batch.py kv_tokens): a request fills its prompt and
every generated token but the last. Each case sits at a block boundary, so that counting one token more
refuses a request that fits, and one token less hands out a block too few for the last decode."""

import asyncio

import pytest

from engine.batch import Batch, FinishReason, Request, StoppingCriteriaParameters, kv_tokens
from engine.config import ServingLimits
from engine.serving.shard import Shard
from router.client import InProcessClient
from router.sched.admission import check_request
from router.sched.allocator import BlockAllocator
from router.sched.scheduler import Scheduler
from tests.conftest import tiny_config
from tests.test_equivalence import PROMPTS

BLOCK = 16
FULL_BLOCKS = 2
LIMITS = ServingLimits(
    max_batch_size=4, max_prefill_tokens=256, max_input_tokens=128, max_total_tokens=256
)
# The KV tokens of each case: exactly FULL_BLOCKS blocks, and one token into the next block.
CASES = {"exact_fit": FULL_BLOCKS * BLOCK, "one_past": FULL_BLOCKS * BLOCK + 1}


class UpFrontClient(InProcessClient):
    """Cannot resume (as TGI's shards): the router reserves every block of a request at admission,
    so no Decode should ever need to add one (TGI's shards would not read them)."""

    resumes = False

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.grown: list[dict] = []

    async def decode(self, batches, grown=None, look_ahead=False):
        if grown:
            self.grown.append(grown)
        return await super().decode(batches, grown, look_ahead)


@pytest.fixture(scope="module")
def shard(tiny_model_dirs):
    shard = Shard(tiny_config(tiny_model_dirs["llama"], max_batch_size=4), show_progress=False)
    shard.warmup(128, 256, 256, 4)
    return shard


def request_filling(shard, kv: int, request_id: int = 0) -> Request:
    """A request whose prompt and max_new_tokens - 1 generated tokens are `kv` tokens."""
    prompt = PROMPTS[1]
    prompt_len = len(shard.tokenizer(prompt)["input_ids"])
    stopping = StoppingCriteriaParameters(max_new_tokens=kv - prompt_len + 1, ignore_eos_token=True)
    return Request(request_id, prompt, stopping_parameters=stopping)


def test_the_rule_is_the_prompt_and_all_but_the_last_token():
    assert kv_tokens(10, 1) == 10  # the only token generated is never fed back
    assert kv_tokens(10, 5) == 14


def test_router_admits_a_request_that_fills_its_blocks_exactly():
    allocator = BlockAllocator(FULL_BLOCKS + 1, BLOCK)  # block 0 is reserved
    fits = Request(1, "x", stopping_parameters=StoppingCriteriaParameters(FULL_BLOCKS * BLOCK - 9))
    check_request(fits, 10, LIMITS, allocator)  # 10 + max_new - 1 = FULL_BLOCKS blocks exactly
    past = Request(2, "x", stopping_parameters=StoppingCriteriaParameters(FULL_BLOCKS * BLOCK - 8))
    with pytest.raises(
        ValueError, match=f"needs {FULL_BLOCKS + 1} KV blocks, the cache has {FULL_BLOCKS}"
    ):
        check_request(past, 10, LIMITS, allocator)


@pytest.mark.parametrize("kv", CASES.values(), ids=CASES.keys())
def test_shard_serves_a_request_in_the_blocks_the_rule_counts(shard, kv):
    """The shard's own blocks: exactly what the rule counts is free, and the request runs to its end."""
    request = request_filling(shard, kv)
    needed = -(-kv // BLOCK)
    hog = shard.allocator.allocate(shard.allocator.num_free - needed)
    try:
        generations, cached = shard.prefill(Batch(1, [request]))
        count = len(generations)
        while cached is not None:
            generations, cached = shard.decode([cached])
            count += len(generations)
    finally:
        shard.clear()
        shard.allocator.free(hog)
    last = generations[-1].generated_text
    assert last.finish_reason == FinishReason.LENGTH
    assert count == last.generated_tokens == request.stopping_parameters.max_new_tokens


@pytest.mark.parametrize("kv", CASES.values(), ids=CASES.keys())
def test_router_blocks_carry_a_request_to_its_end(shard, kv):
    """The router's allocation at admission, sent to the shard, carries it to its end: no block is
    added on the way, and a cache of exactly the blocks the rule counts is enough."""
    request = request_filling(shard, kv)
    prompt_len = len(shard.tokenizer(request.inputs)["input_ids"])

    async def run():
        client = UpFrontClient(shard, max_batch_size=4)
        scheduler = Scheduler(client, BlockAllocator(-(-kv // BLOCK) + 1, BLOCK), LIMITS)
        await scheduler.start()
        try:
            return [g async for g in scheduler.submit(request, prompt_len)], client.grown
        finally:
            await scheduler.stop()
            await client.close()

    generations, grown = asyncio.run(run())
    assert grown == []
    last = generations[-1].generated_text
    assert last.finish_reason == FinishReason.LENGTH
    assert len(generations) == last.generated_tokens == request.stopping_parameters.max_new_tokens
