"""A tiny random LLaVA-NeXT served natively: images of several sizes and aspect ratios tiled at
any resolution (1x2, 2x1 or 2x2 tiles and the base tile), greedy tokens equal to transformers'
generate in a mixed batch of text-only prompts and prompts with 1 to 3 images, strict shapes
(the tower runs at warmed tile-count buckets)."""

from __future__ import annotations

import pytest

from engine.batch import ImageInput, Request, StoppingCriteriaParameters
from engine.serving.shard import Shard
from engine.vision.spec import spec_of_dir
from launcher.generate import request_length, run_requests
from tests.helpers import tiny_config
from tests.vision_models import build_tiny_llava_next, image_bytes, llava_next_reference

NEW_TOKENS = 30


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory, smollm_dir):
    return build_tiny_llava_next(tmp_path_factory.mktemp("llava_next"), smollm_dir)


def image(width: int, height: int, seed: int) -> ImageInput:
    return ImageInput(image_bytes(width, height, seed), "image/png")  # sizes read by the shard


PROMPTS = [  # text and images, in order
    ["Describe this picture: ", image(60, 30, 1), " in detail."],
    ["Once upon a time, in a land far away"],
    [image(20, 50, 2), " and ", image(40, 40, 3), " differ how?"],
    ["Three: ", image(33, 47, 4), image(90, 25, 5), " then ", image(60, 30, 1), "."],
]


def as_request(i: int, chunks: list) -> Request:
    text = "".join(c for c in chunks if isinstance(c, str))
    stopping = StoppingCriteriaParameters(max_new_tokens=NEW_TOKENS, ignore_eos_token=True)
    has_images = any(not isinstance(c, str) for c in chunks)
    return Request(i, text, stopping_parameters=stopping, chunks=chunks if has_images else None)


def test_token_counts_follow_transformers_processor(next_dir):
    import transformers

    spec = spec_of_dir(next_dir)
    processor = transformers.LlavaNextProcessor(
        image_processor=transformers.AutoImageProcessor.from_pretrained(next_dir),
        tokenizer=transformers.AutoTokenizer.from_pretrained(next_dir),
        patch_size=7,
        vision_feature_select_strategy="default",
        num_additional_image_tokens=1,
    )
    for width, height in [(60, 30), (20, 50), (40, 40), (33, 47), (90, 25), (28, 28), (200, 7)]:
        expected = processor._get_number_of_features(height, width, 28, 28) - 1
        assert spec.tokens(width, height) == expected, (width, height)


def test_llava_next_matches_transformers_on_mixed_batches(next_dir):
    shard = Shard(
        tiny_config(next_dir, max_input_tokens=320, max_total_tokens=384, max_prefill_tokens=1024),
        show_progress=False,
    )
    requests = [as_request(i, chunks) for i, chunks in enumerate(PROMPTS)]
    lengths = [request_length(shard, r) for r in requests]
    shard.warmup(max(lengths), sum(lengths), max(lengths) + NEW_TOKENS, len(requests))
    done = run_requests(shard, requests)
    for i, chunks in enumerate(PROMPTS):
        assert done[i].token_ids == llava_next_reference(next_dir, chunks, NEW_TOKENS), (
            f"prompt {i}"
        )
    assert shard.adapter.shapes.strict and not shard.adapter.shapes.unwarmed
    assert shard.vision.stats["images_encoded"] == 5  # one image repeated: encoded once
