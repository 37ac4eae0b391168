"""Prefix caching of prompts with images: KV blocks are keyed by each image's content hash
(engine/vision/keys.py), so a repeated image reuses its KV (and is not encoded again) while the
same text with a different image never does, exact against transformers through the router's
scheduler and prefix cache on an in-process tiny LLaVA; and the next turn of a chat continues the
cached image's KV exactly on Qwen2.5-VL (multimodal rope) and Gemma 3 (images attending both
ways)."""

from __future__ import annotations

import asyncio

import pytest

from engine.batch import Request, StoppingCriteriaParameters
from engine.config import ServingLimits
from engine.errors import InvalidRequestError
from engine.kv_cache import BlockContents
from engine.serving.prefix import check_prefix
from engine.vision.keys import image_start, keyed_ids
from router.client import InProcessClient
from router.images.decode import ImageLimits, checked
from router.images.prompt import keyed_prompt_ids, policy_for
from router.sched.kv_blocks import _whole_images
from router.sched.prefix_cache import PrefixCache
from router.sched.scheduler import Scheduler
from tests.helpers import tiny_shard
from tests.vision_models import image_bytes, llava_reference

NEW = 30
LIMITS = ServingLimits(
    max_batch_size=4, max_prefill_tokens=256, max_input_tokens=112, max_total_tokens=160
)
SYSTEM = (
    "You are a careful assistant who looks at pictures and answers briefly, naming what you "
    "see and nothing else. Here is the picture: "
)
FIRST, OTHER = image_bytes(40, 30, seed=21), image_bytes(40, 30, seed=22)
QUESTION = " What is it? Answer in one short sentence, please."
PROMPTS = [
    [SYSTEM, FIRST, QUESTION],
    # the next turn of the chat: the same image, more text
    [SYSTEM, FIRST, QUESTION + " It is a small cat. And what color is it?"],
    # the same text as the first turn, another image of the same size
    [SYSTEM, OTHER, QUESTION],
]


def as_request(i: int, chunks: list, new_tokens: int = NEW) -> Request:
    text = "".join(c for c in chunks if isinstance(c, str))
    parts = [
        c if isinstance(c, str) else checked(getattr(c, "data", c), ImageLimits()) for c in chunks
    ]
    stopping = StoppingCriteriaParameters(max_new_tokens=new_tokens, ignore_eos_token=True)
    images = any(not isinstance(c, str) for c in parts)  # a text-only prompt carries none
    return Request(i, text, stopping_parameters=stopping, chunks=parts if images else None)


@pytest.fixture(scope="module")
def shard(tiny_llava_dir):
    return tiny_shard(tiny_llava_dir, warmup=LIMITS)


def serve(shard, policy, cache, waves) -> dict[int, list[int]]:
    return serve_waves(shard, policy, cache, LIMITS, PROMPTS, waves)[0]


def serve_waves(shard, policy, allocator, limits, prompts, waves, new_tokens=NEW):
    """({i: tokens}, the scheduler's stats) of prompts[i] of each wave, submitted together after
    the previous wave finished, with the router's keyed lookup ids."""

    async def run():
        client = InProcessClient(shard, max_batch_size=limits.max_batch_size)
        scheduler = Scheduler(client, allocator, limits)
        await scheduler.start()
        out = {}
        try:
            for wave in waves:
                shard.vision.cache.clear()  # only the KV cache may spare an image's encode
                streams = {}
                for i in wave:
                    request = as_request(i, prompts[i], new_tokens)
                    if request.chunks:
                        ids = shard.vision.prompt_ids(request)
                        keyed = keyed_prompt_ids(ids, request.chunks, policy)
                    else:  # a text-only prompt
                        ids = keyed = shard.tokenizer(request.inputs)["input_ids"]
                    streams[i] = scheduler.submit(request, len(ids), keyed)
                for i, stream in streams.items():
                    out[i] = [g.tokens.ids[0] async for g in stream]
        finally:
            await scheduler.stop()
            await client.close()
        return out, scheduler.stats

    return asyncio.run(run())


def requests() -> list[Request]:
    return [as_request(i, chunks) for i, chunks in enumerate(PROMPTS)]


def first_image(keyed: list[int]) -> int:
    return next(i for i, t in enumerate(keyed) if t < 0)


def shared_blocks(cached: list[int], prompt: list[int], block: int) -> int:
    """Whole blocks of `prompt` (its last token always computed) equal to `cached`'s."""
    same = next((i for i, (a, b) in enumerate(zip(cached, prompt)) if a != b), len(prompt))
    return min(same, len(prompt) - 1) // block


def test_a_repeated_image_reuses_its_kv_and_another_image_never_does(shard, tiny_llava_dir):
    policy = policy_for(tiny_llava_dir, shard.tokenizer, ImageLimits())
    cache = PrefixCache(shard.runner.kv_cache.num_blocks, shard.block_size)
    before = dict(shard.vision.stats)
    out = serve(shard, policy, cache, [[0], [1, 2]])
    for i, chunks in enumerate(PROMPTS):
        assert out[i] == llava_reference(tiny_llava_dir, chunks, NEW), f"prompt {i}"
    encoded = shard.vision.stats["images_encoded"] - before["images_encoded"]
    assert encoded == 2  # the first image once (its second turn found its KV), the other once
    assert shard.vision.stats["image_cache_hits"] - before["image_cache_hits"] == 1  # its KV
    keyed = [keyed_prompt_ids(shard.vision.prompt_ids(r), r.chunks, policy) for r in requests()]
    block = shard.block_size
    cached = keyed[0] + out[0][:-1]  # the first turn's prompt and answer
    turn, other = shared_blocks(cached, keyed[1], block), shared_blocks(cached, keyed[2], block)
    image_end = first_image(keyed[0]) + policy.spec.tokens(40, 30)
    assert turn * block >= image_end  # the next turn reused the image's KV
    assert other * block <= first_image(keyed[0])  # the other image never did
    assert other >= 1 and cache.stats.hit_requests == 2
    assert cache.stats.hit_tokens == (turn + other) * block
    assert sum(shard.adapter.shapes.unwarmed.values()) == 0


def test_the_shard_refuses_a_prefix_block_that_holds_another_image(shard):
    first, other = as_request(0, PROMPTS[0]), as_request(1, PROMPTS[2])
    ids = shard.vision.prompt_ids(first)
    assert shard.vision.prompt_ids(other) == ids  # the same text: equal token ids
    contents, blocks = BlockContents(shard.block_size), list(range(1, 8))
    contents.record(blocks, shard.vision.keyed(first, ids), None, len(ids))
    size = len(ids) // shard.block_size * shard.block_size
    first.blocks, first.cache_len = blocks, size
    check_prefix(contents, first, shard.vision.keyed(first, ids))
    other.blocks, other.cache_len = blocks, size
    with pytest.raises(InvalidRequestError, match="does not hold this request's tokens"):
        check_prefix(contents, other, shard.vision.keyed(other, ids))


def test_keys_say_which_image_and_where_it_begins():
    ids = [5, 9, 9, 9, 6, 9, 9, 7]  # two images of 3 and 2 tokens (image token 9)
    keyed = keyed_ids(ids, 9, [(b"first", 3), (b"second", 2)])
    assert keyed[0] == 5 and keyed[4] == 6 and keyed[7] == 7
    assert len(set(keyed[1:4] + keyed[5:7])) == 5 and all(k < 0 for k in keyed[1:4])
    assert keyed_ids(ids, 9, [(b"first", 3), (b"second", 2)]) == keyed  # content only
    assert keyed_ids(ids, 9, [(b"first", 3), (b"third", 2)])[5:7] != keyed[5:7]
    assert [image_start(keyed, p) for p in range(8)] == [0, 1, 1, 1, 4, 5, 5, 7]
    # what the router registers of a chunk never ends inside an image
    assert [_whole_images(keyed, end) for end in (2, 3, 4, 6, 7)] == [1, 1, 4, 5, 7]


def test_blocks_from_the_first_image_on_are_not_published():
    published = []

    class Listener:
        def cleared(self):
            pass

        def stored(self, hashes, parent, token_ids, block_size, adapter):
            published.append(token_ids)

    listener = Listener()
    cache = PrefixCache(num_blocks=8, block_size=4)
    cache.listen(listener)
    ids = keyed_ids([1, 2, 3, 4, 5, 9, 9, 9, 6, 7, 8, 0, 1], 9, [(b"image", 3)])
    cache.register(cache.allocate(len(ids), ids), ids, None)
    assert published == [[1, 2, 3, 4]] and cache.num_cached == 3


# --- Qwen2.5-VL (multimodal rope) and Gemma 3 (images attending both ways) ------------------------

LOOK = "Look: "
LONG_QUESTION = (
    " What is in this picture? Name every color and every shape you can see, then say which "
    "of them is the largest and which is the smallest, in two short sentences."
)


def next_turn_prompts(image: bytes) -> list[list]:
    """A first turn, and the next turn that repeats it (its image first) and asks more."""
    return [[LOOK, image, LONG_QUESTION], [LOOK, image, LONG_QUESTION + " And the background?"]]


def assert_the_next_turn_reuses_the_image_kv(shard, model_dir, prompts, reference):
    """The second turn's lookup hits the first's blocks past the image: the image is encoded
    once, the prefill continues the cached context, and both turns equal transformers'."""
    policy = policy_for(model_dir, shard.tokenizer, ImageLimits())
    cache = PrefixCache(shard.runner.kv_cache.num_blocks, shard.block_size)
    before = dict(shard.vision.stats)
    out, _ = serve_waves(shard, policy, cache, LIMITS, prompts, [[0], [1]])
    assert cache.stats.hit_requests == 1
    first = as_request(0, prompts[0])
    keyed = shard.vision.keyed(first, shard.vision.prompt_ids(first))
    image_end = first_image(keyed) + shard.vision.counts(first)[0]
    assert cache.stats.hit_tokens >= image_end  # the hit holds the whole image
    assert shard.vision.stats["images_encoded"] - before["images_encoded"] == 1
    assert shard.vision.stats["image_cache_hits"] - before["image_cache_hits"] == 1  # its KV
    for i, chunks in enumerate(prompts):
        assert out[i] == reference(model_dir, chunks, NEW), f"turn {i}"
    assert sum(shard.adapter.shapes.unwarmed.values()) == 0


def test_qwen2_5_vl_next_turn_continues_the_cached_image_exact(tmp_path_factory, smollm_dir):
    from tests.test_vision_qwen2_5_vl import build_tiny_qwen2_5_vl, qwen_reference

    model_dir = build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"), smollm_dir)
    shard = tiny_shard(model_dir, warmup=LIMITS)
    prompts = next_turn_prompts(image_bytes(24, 16, seed=21))  # 24 image tokens
    assert_the_next_turn_reuses_the_image_kv(shard, model_dir, prompts, qwen_reference)


def test_gemma3_next_turn_continues_the_cached_image_exact(tmp_path_factory, smollm_dir):
    from tests.vision_models import build_tiny_gemma3, gemma3_reference

    model_dir = build_tiny_gemma3(tmp_path_factory.mktemp("gemma3"), smollm_dir)
    shard = tiny_shard(model_dir, warmup=LIMITS)
    prompts = next_turn_prompts(image_bytes(40, 30, seed=21))
    assert_the_next_turn_reuses_the_image_kv(shard, model_dir, prompts, gemma3_reference)
