"""A tiny random LLaVA served exactly: greedy tokens equal transformers' generate on the same
weights and images, in a mixed batch of text-only prompts and prompts with 1 to 3 images of
several sizes, with strict shapes (the tower's image buckets are warmed with the rest)."""

from __future__ import annotations

import pytest

from engine.serving.shard import Shard
from launcher.generate import request_length, run_requests
from tests.helpers import tiny_config
from tests.vision_models import image_request, llava_reference, png_image

NEW_TOKENS = 30


PROMPTS = [  # text and images, in order
    ["Describe this picture: ", png_image(40, 30, 1), " in detail."],
    ["Once upon a time, in a land far away"],
    [png_image(28, 28, 2), " and ", png_image(64, 20, 3), " differ how?"],
    ["Three: ", png_image(33, 47, 4), png_image(90, 60, 5), " then ", png_image(40, 30, 1), "."],
]


def as_request(i: int, chunks: list):
    return image_request(i, chunks, NEW_TOKENS)


@pytest.fixture(scope="module")
def shard(tiny_llava_dir):
    return Shard(tiny_config(tiny_llava_dir), show_progress=False)


def test_llava_matches_transformers_on_mixed_batches(shard, tiny_llava_dir):
    requests = [as_request(i, chunks) for i, chunks in enumerate(PROMPTS)]
    lengths = [request_length(shard, r) for r in requests]
    shard.warmup(max(lengths), sum(lengths), max(lengths) + NEW_TOKENS, len(requests))
    done = run_requests(shard, requests)
    for i, chunks in enumerate(PROMPTS):
        assert done[i].token_ids == llava_reference(tiny_llava_dir, chunks, NEW_TOKENS), (
            f"prompt {i}"
        )
    assert shard.adapter.shapes.strict and not shard.adapter.shapes.unwarmed
    # five distinct images, one repeated: encoded once
    assert shard.vision.stats["images_encoded"] == 5
    assert shard.vision.stats["image_cache_hits"] == 1


def test_a_chunk_never_ends_inside_an_image():
    from types import SimpleNamespace

    from engine.batch import Request
    from engine.serving.chunks import plan_chunks

    def seq(computed, spans, chunk_len=None, end=100):
        request = Request(0, "", chunk_len=chunk_len)
        return SimpleNamespace(
            request=request, computed=computed, cache_len=0, prefill_end=end, image_spans=spans
        )

    # the step's budget would end the chunk at 32, inside the image at [20, 36): it ends at 20
    assert [p[1:] for p in plan_chunks([seq(0, [(20, 36)])], 32, 64)] == [(0, 20)]
    assert [p[1:] for p in plan_chunks([seq(0, [(20, 36)], chunk_len=25)], 64, 64)] == [(0, 20)]
    # a chunk that starts at the image and cannot hold it whole still cuts it
    assert [p[1:] for p in plan_chunks([seq(20, [(20, 36)])], 8, 64)] == [(20, 28)]
    # ... where no step could hold it: one whose budget others spent waits for the next step
    text, pictured = seq(0, [], end=56), seq(20, [(20, 36)])
    assert [(p[0] is text, *p[1:]) for p in plan_chunks([text, pictured], 64, 64)] == [
        (True, 0, 56)
    ]
    assert [p[1:] for p in plan_chunks([pictured], 64, 64)] == [(20, 84)]
    # a first chunk_len shorter than the image cuts it (no later step would hold it either)
    assert [p[1:] for p in plan_chunks([seq(0, [(0, 36)], chunk_len=8)], 64, 64)] == [(0, 8)]
    assert [p[1:] for p in plan_chunks([seq(0, [(40, 56)])], 32, 64)] == [(0, 32)]


def test_chunked_prompts_with_images_match_transformers(tiny_llava_dir):
    """The 3-image prompt (54 tokens) is longer than the longest prefill bucket (48, which
    would end inside its third image, at [37, 53)): it is computed in chunks, and stays exact."""
    shard = Shard(tiny_config(tiny_llava_dir), show_progress=False)
    prompts = [PROMPTS[2], PROMPTS[3]]
    requests = [as_request(i, chunks) for i, chunks in enumerate(prompts)]
    lengths = [request_length(shard, r) for r in requests]
    shard.warmup(max(lengths), sum(lengths), max(lengths) + NEW_TOKENS, len(requests))
    done = run_requests(shard, requests)
    for i, chunks in enumerate(prompts):
        assert done[i].token_ids == llava_reference(tiny_llava_dir, chunks, NEW_TOKENS)
    assert shard.chunk_stats["chunked_prompts"] == 1
    assert shard.adapter.shapes.strict and not shard.adapter.shapes.unwarmed
