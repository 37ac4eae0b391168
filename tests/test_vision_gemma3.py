"""A tiny random Gemma 3 VLM served natively (SigLIP tower, our Gemma 3 text model with sliding
layers): each image expanded as Gemma3Processor expands it, its tokens attending to each other
both ways in prefill, greedy tokens equal to transformers' generate in a mixed batch of text-only
prompts and prompts with 1 to 3 images of several sizes, strict shapes; a prefill chunk never cuts
an image."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from engine.batch import Request
from engine.serving.chunks import plan_chunks
from engine.serving.shard import Shard
from launcher.generate import request_length, run_requests
from router.images.decode import ImageLimits
from router.images.prompt import image_prompt, markdown, policy_for
from tests.helpers import tiny_config
from tests.vision_models import (
    build_tiny_gemma3,
    gemma3_reference,
    image_request,
    png_image,
)

NEW_TOKENS = 30
LONG = "Tell me everything about the two pictures, their colors and their shapes, "

PROMPTS = [  # text and images, in order
    ["Describe this picture: ", png_image(60, 30, 1), " in detail."],
    ["Once upon a time, in a land far away"],
    [png_image(20, 50, 2), " and ", png_image(40, 40, 3), " differ how?"],
    ["Three: ", png_image(33, 47, 4), png_image(90, 25, 5), " then ", png_image(60, 30, 1), "."],
    [LONG * 4, png_image(50, 40, 6), " or ", png_image(25, 35, 7), LONG],  # past the window
]


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory, smollm_dir):
    return build_tiny_gemma3(tmp_path_factory.mktemp("gemma3"), smollm_dir)


@pytest.fixture(scope="module")
def served(gemma3_dir):
    """The shard after serving every prompt at once, and what each generated."""
    shard = Shard(tiny_config(gemma3_dir), show_progress=False)
    requests = [image_request(i, chunks, NEW_TOKENS) for i, chunks in enumerate(PROMPTS)]
    lengths = [request_length(shard, r) for r in requests]
    shard.warmup(max(lengths), sum(lengths), max(lengths) + NEW_TOKENS, len(requests))
    return shard, run_requests(shard, requests)


def test_prompts_expand_as_gemma3_processor_does(served, gemma3_dir):
    import transformers

    shard, _ = served
    processor = transformers.AutoProcessor.from_pretrained(gemma3_dir)
    policy = policy_for(gemma3_dir, processor.tokenizer, ImageLimits())
    for i, chunks in enumerate(PROMPTS):
        if len(chunks) == 1:
            continue
        boi = processor.tokenizer.boi_token
        text = "".join(c if isinstance(c, str) else boi for c in chunks)
        expected = processor(text=text, images=[_pil(c) for c in chunks if not isinstance(c, str)])[
            "input_ids"
        ][0]
        assert shard.vision.prompt_ids(image_request(i, chunks, 1)) == expected, f"prompt {i}"
        counted = image_prompt(_markdown(chunks), policy).counted  # the router's count
        assert processor.tokenizer(counted)["input_ids"] == expected, f"prompt {i}"


def _pil(image):
    import io

    from PIL import Image

    return Image.open(io.BytesIO(image.data)).convert("RGB")


def _markdown(chunks: list) -> str:
    return "".join(c if isinstance(c, str) else markdown(c) for c in chunks)


def test_gemma3_matches_transformers_on_mixed_batches(served, gemma3_dir):
    shard, done = served
    for i, chunks in enumerate(PROMPTS):
        expected = gemma3_reference(gemma3_dir, chunks, NEW_TOKENS)
        assert done[i].token_ids == expected, f"prompt {i}"
    assert shard.adapter.shapes.strict and not shard.adapter.shapes.unwarmed
    assert shard.vision.stats["images_encoded"] == 7  # one image repeated: encoded once


def test_an_image_is_never_cut_where_its_tokens_attend_both_ways():
    def seq(computed, spans, chunk_len=None, end=100):
        request = Request(0, "", chunk_len=chunk_len)
        return SimpleNamespace(
            request=request,
            computed=computed,
            cache_len=computed,
            prefill_end=end,
            image_spans=spans,
        )

    def plan(sequence, budget, cap=64):
        return [p[1:] for p in plan_chunks([sequence], budget, cap, uncut=True)]

    assert plan(seq(0, [(20, 36)]), 32) == [(0, 20)]  # ends before the image, as LLaVA's
    # a chunk starting at the image holds it whole past a first chunk_len, or waits
    assert plan(seq(20, [(20, 36)], chunk_len=8), 64) == [(20, 36)]
    assert plan(seq(20, [(20, 36)]), 8) == []
    assert plan(seq(24, [(20, 36)]), 12) == [(24, 36)]  # the rest after a cached prefix
