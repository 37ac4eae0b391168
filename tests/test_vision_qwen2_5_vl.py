"""A tiny random Qwen2.5-VL served natively: dynamic resolution in planned grid buckets (images of
several sizes, some resized to the nearest planned grid), multimodal rope (3-row positions in the
prefill, a per-row delta in the decode), greedy tokens equal to transformers' generate for a mixed
batch of text-only prompts and prompts with 1 to 3 images, strict shapes; also computed in chunks
that never split an image, preempted and resumed, and through `bucketserve generate --image`. The
tower runs on metadata built on the host, exactly transformers' tower; its grids are image
buckets that `--record-shapes`, `fitted` and warmup profiles carry."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from engine.serving.shard import Shard
from engine.vision.spec import spec_of_dir
from launcher.generate import request_length, run_requests
from tests.helpers import tiny_config
from tests.vision_models import image_bytes, image_request, png_image

NEW_TOKENS = 30
FACTOR = 4  # pixels per merged patch side: patch 2, merge 2
MIN_PIXELS, MAX_PIXELS = 4 * FACTOR**2, 48 * FACTOR**2  # 4 to 48 tokens an image
VISION_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]
REPO = Path(__file__).resolve().parent.parent


def build_tiny_qwen2_5_vl(out_dir: Path, tokenizer_dir: Path, seed: int = 0) -> Path:
    """The embedded model's tokenizer plus Qwen's vision tokens, a 2-layer Qwen2 text model
    (head_dim 16, mrope_section 2+3+3) and a 2-block tower with window and full attention."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": VISION_TOKENS})
    ids = dict(zip(VISION_TOKENS, tokenizer.convert_tokens_to_ids(VISION_TOKENS)))
    config = transformers.Qwen2_5_VLConfig(
        text_config=dict(
            vocab_size=len(tokenizer),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=512,
            initializer_range=0.2,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 50.0,
                "mrope_section": [2, 3, 3],
            },
            bos_token_id=1,
            eos_token_id=2,
            tie_word_embeddings=False,
        ),
        vision_config=dict(
            depth=2,
            hidden_size=32,
            intermediate_size=64,
            num_heads=2,
            patch_size=2,
            spatial_merge_size=2,
            temporal_patch_size=2,
            window_size=8,
            out_hidden_size=64,
            fullatt_block_indexes=[1],
            initializer_range=0.2,
        ),
        image_token_id=ids["<|image_pad|>"],
        video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    transformers.Qwen2_5_VLForConditionalGeneration(config).eval().save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    processor = transformers.Qwen2VLImageProcessor(
        min_pixels=MIN_PIXELS, max_pixels=MAX_PIXELS, patch_size=2, merge_size=2
    )
    processor.save_pretrained(out_dir)
    return out_dir


def image_processor(model_dir):
    """transformers' Qwen2VLImageProcessor as saved with the model."""
    import transformers

    return transformers.AutoImageProcessor.from_pretrained(model_dir)


def decoded_images(chunks: list) -> list:
    """The prompt's images as PIL images, as they are (the processor picks each one's grid)."""
    from PIL import Image

    return [
        Image.open(io.BytesIO(getattr(c, "data", c))).convert("RGB")
        for c in chunks
        if not isinstance(c, str)
    ]


def reference_inputs(model_dir, chunks: list) -> dict:
    """What transformers' Qwen2_5_VLProcessor gives the model (it cannot be built here: its video
    processor needs torchvision), made as it makes them: each image's `<|image_pad|>` repeated
    grid_thw.prod() / merge_size**2 times, mm_token_type_ids 1 at the image tokens."""
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    processor = image_processor(model_dir)
    images = decoded_images(chunks)
    pixels = processor(images=images, return_tensors="pt") if images else {}
    counts = iter(
        (grid.prod() // processor.merge_size**2).item() for grid in pixels.get("image_grid_thw", [])
    )
    text = "".join(
        c
        if isinstance(c, str)
        else f"<|vision_start|>{'<|image_pad|>' * next(counts)}<|vision_end|>"
        for c in chunks
    )
    inputs = dict(tokenizer([text], return_tensors="pt"), **pixels)
    token = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == token).int()
    return inputs


def qwen_reference(model_dir, chunks: list, new_tokens: int, eos: bool = False) -> list[int]:
    """transformers' own Qwen2.5-VL (its own tower, grids and M-RoPE: get_rope_index), greedy on
    one prompt of text pieces and images in order; eos: stop at EOS (else new_tokens)."""
    import transformers

    model = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    inputs = reference_inputs(model_dir, chunks)
    least = {} if eos else {"min_new_tokens": new_tokens}
    out = model.generate(**inputs, max_new_tokens=new_tokens, do_sample=False, **least)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory, smollm_dir):
    return build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"), smollm_dir)


def test_tower_on_host_metadata_equals_transformers_tower(qwen_dir):
    """The tower run on its host-built layout padded to a bucket (as the encoder runs it) gives
    transformers' own tower's features, at grids with one window and with several (edge windows
    short), unpadded and padded (the padding attends to itself only)."""
    import transformers

    from engine.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration as Ours
    from engine.models.qwen2_5_vl import tower_layout

    visual = transformers.Qwen2_5_VLForConditionalGeneration.from_pretrained(
        qwen_dir, dtype=torch.float32
    ).model.visual.eval()
    ours = SimpleNamespace(visual=visual)
    torch.manual_seed(0)
    for thw, bucket in [((1, 4, 4), 4), ((1, 8, 12), 32), ((1, 2, 26), 16), ((1, 14, 6), 24)]:
        tokens = thw[1] * thw[2] // 4
        pixels = torch.randn(thw[1] * thw[2], 3 * 2 * 2 * 2)
        padded = torch.cat([pixels, torch.randn((bucket - tokens) * 4, pixels.shape[1])])
        with torch.inference_mode():
            expected = visual(pixels, grid_thw=torch.tensor([thw])).pooler_output
            layout = tower_layout(visual, thw, bucket)
            got = Ours._tower_forward(ours, padded, *layout)
        assert got.shape[0] == bucket
        torch.testing.assert_close(got[:tokens], expected, rtol=1e-5, atol=1e-5, msg=str(thw))


SIZES = [(24, 16), (20, 36), (40, 40), (66, 13), (33, 47), (8, 8), (90, 7), (5, 60)]
PROMPTS = [  # text and images, in order; (20, 36) and (33, 47) are off the token ladder
    ["Describe this picture: ", png_image(24, 16, 1), " in detail."],
    ["Once upon a time, in a land far away"],
    [png_image(20, 36, 2), " and ", png_image(40, 40, 3), " differ how?"],
    ["Three: ", png_image(66, 13, 4), png_image(33, 47, 5), " then ", png_image(24, 16, 1), "."],
]


def test_token_counts_follow_transformers_processor(qwen_dir):
    """The router's count of an image (spec.tokens) is the processor's own, for every size."""
    from PIL import Image

    spec, processor = spec_of_dir(qwen_dir), image_processor(qwen_dir)
    for width, height in SIZES:
        image = Image.open(io.BytesIO(image_bytes(width, height))).convert("RGB")
        grid = processor(images=[image], return_tensors="pt")["image_grid_thw"][0]
        expected = (grid.prod() // processor.merge_size**2).item()
        assert spec.tokens(width, height) == expected, (width, height)
        patches = processor.get_number_of_image_patches(height, width, {})
        assert patches // processor.merge_size**2 == expected, (width, height)


def serve(model_dir, prompts: list, prefill_tokens: int = 0, **overrides) -> tuple[Shard, dict]:
    """The prompts' completions on a shard warmed for them (`prefill_tokens`: a prefill budget
    shorter than the prompts, which computes them in chunks)."""
    settings = dict(max_input_tokens=320, max_total_tokens=384, max_prefill_tokens=1024)
    shard = Shard(tiny_config(model_dir, **{**settings, **overrides}), show_progress=False)
    requests = [image_request(i, chunks, NEW_TOKENS) for i, chunks in enumerate(prompts)]
    lengths = [request_length(shard, r) for r in requests]
    budget = prefill_tokens or sum(lengths)
    shard.warmup(max(lengths), budget, max(lengths) + NEW_TOKENS, len(requests))
    return shard, run_requests(shard, requests)


@pytest.fixture(scope="module")
def references(qwen_dir):
    return [qwen_reference(qwen_dir, chunks, NEW_TOKENS) for chunks in PROMPTS]


def test_qwen2_5_vl_matches_transformers_on_mixed_batches(qwen_dir, references):
    shard, done = serve(qwen_dir, PROMPTS)
    for i, expected in enumerate(references):
        assert done[i].token_ids == expected, f"prompt {i}"
    assert shard.adapter.shapes.strict and not shard.adapter.shapes.unwarmed
    assert shard.vision.stats["images_encoded"] == 5  # one image repeated: encoded once
    # the 3-image prompt (124 tokens) does not fit the step beside the others: it is computed
    # in two chunks, the second (its last image and text) at its own 3-row positions
    assert shard.chunk_stats["chunked_prompts"] == 1


@pytest.mark.slow
def test_generate_command_takes_image_files(qwen_dir, tmp_path):
    picture = tmp_path / "cat.png"
    picture.write_bytes(image_bytes(30, 22, seed=10))
    command = [sys.executable, "-m", "launcher", "generate", "--model-id", str(qwen_dir)]
    command += ["--device", "cpu", "--dtype", "float32", "--strict-shapes", "on", "--json"]
    command += ["--image", str(picture), "--prompt", "Describe it.", "--max-new-tokens", "30"]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    ids = json.loads(result.stdout.splitlines()[-1])["token_ids"]
    chunks = [picture.read_bytes(), "Describe it."]
    assert ids == qwen_reference(qwen_dir, chunks, NEW_TOKENS, eos=True)


def test_speculation_is_refused_with_multimodal_rope(qwen_dir):
    """Verify and draft steps carry no 3-row positions yet: one clear error at start."""
    from engine.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match="multimodal rope"):
        Shard(tiny_config(qwen_dir, speculate="ngram"), show_progress=False)


def test_a_preempted_image_request_resumes_exact(qwen_dir, references):
    """A KV budget too small for every request as they grow: the newest are preempted and
    resumed (their prompt and generated tokens recomputed at their 3-row and delta positions),
    and every stream still equals transformers'."""
    from engine.config import ServingLimits
    from router.images.decode import ImageLimits
    from router.images.prompt import policy_for
    from router.sched.allocator import BlockAllocator
    from tests.test_vision_prefix import serve_waves

    limits = ServingLimits(
        max_batch_size=4, max_prefill_tokens=512, max_input_tokens=160, max_total_tokens=192
    )
    shard = Shard(tiny_config(qwen_dir), show_progress=False)
    shard.warmup(limits.max_input_tokens, limits.max_prefill_tokens, limits.max_total_tokens, 4)
    lengths = [request_length(shard, image_request(i, c, 1)) for i, c in enumerate(PROMPTS)]
    block = shard.block_size
    blocks = sum(-(-n // block) for n in lengths) + 2  # all admitted; not all can grow
    assert -(-(max(lengths) + NEW_TOKENS) // block) < blocks  # the longest alone fits
    policy = policy_for(qwen_dir, shard.tokenizer, ImageLimits())
    done, stats = serve_waves(
        shard, policy, BlockAllocator(blocks + 1, block), limits, PROMPTS, [range(4)], NEW_TOKENS
    )
    assert stats.preemptions > 0
    assert [done[i] for i in range(4)] == references
    assert sum(shard.adapter.shapes.unwarmed.values()) == 0


def test_token_buckets_are_recorded_fitted_and_profiled(qwen_dir, tmp_path):
    """--record-shapes writes each tower run at its image's token count; a fitted plan on that
    trace holds the bucket of that count (and every other: the router admits any image the
    processor takes); a warmup profile times every bucket, and a shard served with it warms
    every bucket."""
    from engine.buckets.images import ImageBucket
    from engine.buckets.shapes import Shape, load_shapes
    from engine.vision.grids import token_buckets
    from engine.warmup.profile import measure, write_profile

    settings = dict(
        max_batch_size=4, max_input_tokens=64, max_total_tokens=96, max_prefill_tokens=128
    )
    trace = tmp_path / "shapes.jsonl"
    shard = Shard(tiny_config(qwen_dir, record_shapes=str(trace), **settings), show_progress=False)
    shard.warmup()
    run_requests(shard, [image_request(0, PROMPTS[0], 2)])
    tokens = spec_of_dir(qwen_dir).tokens(24, 16)
    assert [s for s in load_shapes(trace) if s.phase == "image"] == [Shape("image", 1, tokens)]
    every = {ImageBucket(1, t) for t in token_buckets(FACTOR, MIN_PIXELS, MAX_PIXELS)}
    assert set(shard.vision.planned) == every
    key = shard.vision.planned_size(tokens)

    fitted = Shard(
        tiny_config(qwen_dir, bucket_strategy="fitted", bucket_shapes=str(trace), **settings),
        show_progress=False,
    )
    fitted.warmup()
    assert ImageBucket(1, key) in fitted.runner.plan.images
    assert set(fitted.runner.plan.images) == every == set(fitted.vision.planned)

    entries = measure(fitted, 1)  # warmup-profile's timings: one entry a bucket
    timed = {(e["batch_size"], e["size"]) for e in entries if e["phase"] == "image"}
    assert timed == {(b.count, b.size) for b in every}
    assert all(e["latency_s"] > 0 for e in entries if e["phase"] == "image")
    profile = write_profile(tmp_path / "profile", fitted, entries, "fitted", {})
    served = Shard(
        tiny_config(qwen_dir, warmup_profile=str(profile), **settings), show_progress=False
    )
    served.warmup()
    warmed = {b for b in served.adapter.shapes.warmed if b[0] == "vision"}
    assert warmed == {served.vision.shape(b) for b in every}
