"""A vision-language model with the rest of the engine: a LoRA adapter on a tiny LLaVA's language
model gives the tokens of transformers + peft with the adapter merged; two tensor-parallel shards
(gloo, the tower replicated) give the tokens of one; `n` = 3 on an image prompt encodes the
image once."""

from __future__ import annotations

import asyncio
import shutil
from dataclasses import replace

import pytest
import torch

from engine.serving.shard import Shard
from launcher.generate import request_length, run_requests
from tests.helpers import tiny_config
from tests.vision_models import image_bytes, image_request, llava_reference, png_image

NEW_TOKENS = 20
PROMPTS = [
    ["Describe this picture: ", png_image(40, 30, 1), " in detail."],
    ["Once upon a time, in a land far away"],
    [png_image(28, 28, 2), " and ", png_image(64, 20, 3), " differ how?"],
]
# The language model's modules only: CLIP's attention has q/k/v projections too.
TEXT_TARGETS = r".*language_model.*\.(q_proj|v_proj|o_proj|up_proj|down_proj)"


@pytest.fixture(scope="module")
def lora_dirs(tiny_llava_dir, tmp_path_factory):
    """A random PEFT adapter on the tiny LLaVA's language model, and the model with it merged
    (saved as a LLaVA directory, so transformers' own generate can be the reference)."""
    import transformers
    from peft import LoraConfig, PeftModel, get_peft_model

    root = tmp_path_factory.mktemp("vlm_lora")
    base = transformers.LlavaForConditionalGeneration.from_pretrained(
        tiny_llava_dir, dtype=torch.float32
    )
    torch.manual_seed(5)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=TEXT_TARGETS, init_lora_weights=False)
    adapted = get_peft_model(base, config)
    with torch.no_grad():  # PEFT's default B is zero: it would change nothing
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.3)
    adapted.save_pretrained(root / "adapter")
    fresh = transformers.LlavaForConditionalGeneration.from_pretrained(
        tiny_llava_dir, dtype=torch.float32
    )
    merged = PeftModel.from_pretrained(fresh, root / "adapter").merge_and_unload()
    merged.save_pretrained(root / "merged")
    for name in ("tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"):
        if (tiny_llava_dir / name).exists():
            shutil.copy(tiny_llava_dir / name, root / "merged" / name)
    for extra in tiny_llava_dir.glob("special_tokens_map.json"):
        shutil.copy(extra, root / "merged" / extra.name)
    return root / "adapter", root / "merged"


def test_lora_on_a_vlm_language_model_matches_peft_merged(tiny_llava_dir, lora_dirs):
    adapter, merged = lora_dirs
    shard = Shard(
        tiny_config(tiny_llava_dir, lora_adapters=(("alpha", str(adapter)),)),
        show_progress=False,
    )
    adapters = ["alpha", None, "alpha"]  # one base-model request in the batch
    requests = [
        replace(image_request(i, chunks, NEW_TOKENS), adapter_id=name)
        for i, (chunks, name) in enumerate(zip(PROMPTS, adapters))
    ]
    lengths = [request_length(shard, r) for r in requests]
    shard.warmup(max(lengths), sum(lengths), max(lengths) + NEW_TOKENS, len(requests))
    done = run_requests(shard, requests)
    for i, (chunks, name) in enumerate(zip(PROMPTS, adapters)):
        reference_dir = merged if name else tiny_llava_dir
        assert done[i].token_ids == llava_reference(reference_dir, chunks, NEW_TOKENS), i
    assert shard.adapter.shapes.strict and not shard.adapter.shapes.unwarmed


def test_n_siblings_share_one_encode(tiny_llava_dir):
    """OpenAI `n` = 3: the router's group of three requests on one prompt (router/sched/fanout.py);
    the siblings copy the first's prompt KV, so its image is encoded once."""
    from router.client import InProcessClient
    from router.offline import _collect, limits_of
    from router.sched.allocator import BlockAllocator
    from router.sched.fanout import siblings
    from router.sched.scheduler import Scheduler

    shard = Shard(tiny_config(tiny_llava_dir), show_progress=False)
    shard.warmup()
    chunks = ["What is it? ", png_image(50, 40, 9)]
    first = image_request(1, chunks, NEW_TOKENS)
    first = replace(first, parameters=replace(first.parameters, seed=0))  # the router draws one
    group = siblings(first, 3, iter(range(2, 10)).__next__)
    length = request_length(shard, first)

    async def run():
        client = InProcessClient(shard, max_batch_size=shard.limits.max_batch_size)
        capacity = shard.runner.kv_cache.capacity_tokens
        allocator = BlockAllocator(capacity // shard.block_size + 1, shard.block_size)
        scheduler = Scheduler(client, allocator, limits_of(shard, 3))
        await scheduler.start()
        try:
            streams = scheduler.submit_group(group, length)
            return await asyncio.gather(*(_collect(s) for s in streams))
        finally:
            await scheduler.stop()
            await client.close()

    outputs = asyncio.run(run())
    expected = llava_reference(tiny_llava_dir, chunks, NEW_TOKENS)
    assert [[t for g in out for t in g.tokens.ids] for out in outputs] == [expected] * 3
    assert shard.vision.stats["images_encoded"] == 1
    assert shard.vision.stats["image_cache_hits"] == 0  # the siblings never looked for it
    assert shard.serving_stats()["copied_prompts"] == 2


def image_pb_request(request_id: int, chunks: list, new_tokens: int):
    """A v3 request as a TGI router writes one for a prompt with images: its chunks in order."""
    from engine.wire import generate_pb2 as pb
    from tests.test_server import text_request

    request = text_request(request_id, "".join(c for c in chunks if isinstance(c, str)), new_tokens)
    del request.input_chunks.chunks[:]
    for chunk in chunks:
        if isinstance(chunk, str):
            request.input_chunks.chunks.append(pb.InputChunk(text=chunk))
        else:
            image = pb.Image(data=chunk, mimetype="image/png")
            request.input_chunks.chunks.append(pb.InputChunk(image=image))
    return request


TP_PROMPTS = [  # image bytes, as the wire carries them
    ["Describe this picture: ", image_bytes(40, 30, 1), " now."],
    ["Once upon a time, in a land far away"],
    [image_bytes(28, 28, 2), " and ", image_bytes(64, 20, 3), " differ how?"],
    ["Again: ", image_bytes(40, 30, 1)],
]


@pytest.mark.slow
def test_two_shards_of_a_vlm_give_the_tokens_of_one(tiny_llava_dir):
    """Two shard processes (torch.distributed over gloo): the language model split in two, the
    vision tower replicated; a mixed batch of image and text prompts gives transformers' tokens."""
    from tests.test_tensor_parallel import run_sharded, two_batches_to_the_end

    def body(router, _text_requests):
        requests = [image_pb_request(k, c, NEW_TOKENS) for k, c in enumerate(TP_PROMPTS)]
        return two_batches_to_the_end(router, requests)

    tokens = run_sharded(tiny_llava_dir, 2, body)
    for k, chunks in enumerate(TP_PROMPTS):
        assert tokens[k] == llava_reference(tiny_llava_dir, chunks, NEW_TOKENS), k
