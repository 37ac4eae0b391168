"""A tiny random LLaVA-NeXT served natively: images of several sizes and aspect ratios tiled at
any resolution (1x2, 2x1 or 2x2 tiles and the base tile), greedy tokens equal to transformers'
generate in a mixed batch of text-only prompts and prompts with 1 to 3 images, strict shapes
(the tower runs at warmed tile-count buckets)."""

from __future__ import annotations

import pytest

from engine.serving.shard import Shard
from engine.vision.spec import spec_of_dir
from launcher.generate import request_length, run_requests
from tests.helpers import tiny_config
from tests.vision_models import (
    build_tiny_llava_next,
    image_request,
    llava_next_reference,
    png_image,
)

NEW_TOKENS = 30


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory, smollm_dir):
    return build_tiny_llava_next(tmp_path_factory.mktemp("llava_next"), smollm_dir)


PROMPTS = [  # text and images, in order
    ["Describe this picture: ", png_image(60, 30, 1), " in detail."],
    ["Once upon a time, in a land far away"],
    [png_image(20, 50, 2), " and ", png_image(40, 40, 3), " differ how?"],
    ["Three: ", png_image(33, 47, 4), png_image(90, 25, 5), " then ", png_image(60, 30, 1), "."],
]


def as_request(i: int, chunks: list):
    return image_request(i, chunks, NEW_TOKENS)


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
