"""Image buckets everywhere a bucket plan goes: a trace's image records fit them, bucket files and
warmup profiles carry them, `--record-shapes` records the tower's runs, strict mode refuses an
image no warmed bucket holds; and random traffic with images (LLaVA, LLaVA-NeXT, Qwen2.5-VL,
Gemma 3) under strict shapes and `--simulate hpu` meets no unwarmed shape, compiles nothing and
breaks no graph after warmup, its greedy tokens those of the same shard without the simulator."""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from engine.buckets.images import (
    ImageBucket,
    ImageLimits,
    fitted_images,
    image_cost,
    image_grid,
    split_run,
)
from engine.buckets.plan import image_plan, load_bucket_file
from engine.buckets.shapes import Shape, load_shapes, parse_shape
from engine.errors import UnwarmedShapeError
from engine.serving.shard import Shard
from launcher.generate import request_length, run_requests
from tests.helpers import tiny_config
from tests.vision_models import build_tiny_gemma3, build_tiny_llava_next, image_request, png_image

TOWER = ImageLimits(8, (28,))


def image_runs(counts: dict[int, int]) -> list[Shape]:
    return [Shape("image", count, 28) for count, times in counts.items() for _ in range(times)]


def test_fitted_image_buckets_pad_a_trace_least_and_keep_the_largest():
    trace = image_runs({3: 50, 5: 30, 6: 10, 1: 5, 19: 1})  # 19: split into 8 + 8 + 3
    fitted = fitted_images(TOWER, trace)
    assert len(fitted) <= len(image_grid(TOWER)) and ImageBucket(8, 28) in fitted
    assert {ImageBucket(3, 28), ImageBucket(5, 28)} <= set(fitted)
    grid_cost, fitted_cost = (
        image_cost(image_grid(TOWER), TOWER, trace),
        image_cost(fitted, TOWER, trace),
    )
    assert fitted_cost["real"] == grid_cost["real"] == 3 * 50 + 5 * 30 + 6 * 10 + 5 + 19
    assert fitted_cost["padded"] < grid_cost["padded"]
    # the fitted strategy uses them; the grid strategies and a trace without images the grid
    assert image_plan("fitted", TOWER, trace) == fitted
    assert image_plan("exponential", TOWER, trace) == image_grid(TOWER)
    assert image_plan("fitted", TOWER, [Shape("decode", 2, 4)]) == image_grid(TOWER)
    assert image_plan("fitted", None, trace) == ()  # a text model has none


def test_runs_split_over_the_largest_bucket_and_pad_the_rest():
    buckets = (ImageBucket(2, 28), ImageBucket(8, 28))
    assert split_run(buckets, 11, 28) == [(8, ImageBucket(8, 28)), (3, ImageBucket(8, 28))]
    assert split_run(buckets, 2, 20) == [(2, ImageBucket(2, 28))]  # a smaller size pads up
    assert split_run(buckets, 1, 56) == []  # no bucket holds it


def test_image_records_and_bucket_files(tmp_path):
    record = {"phase": "image", "batch_size": 5, "size": 28}
    assert parse_shape(json.dumps(record)) == Shape("image", 5, 28)
    assert Shape("image", 5, 28).as_json() == record
    with pytest.raises(ValueError, match="context_blocks belongs"):
        parse_shape(json.dumps({**record, "context_blocks": 1}))
    path = tmp_path / "buckets.json"
    plan = {"prefill_buckets": [[1, 64]], "decode_buckets": [[1, 4]]}
    path.write_text(json.dumps({**plan, "image_buckets": [[3, 28], [8, 28]]}))
    assert load_bucket_file(path).images == (ImageBucket(3, 28), ImageBucket(8, 28))
    assert image_plan("file", TOWER, bucket_file=path) == (ImageBucket(3, 28), ImageBucket(8, 28))
    path.write_text(json.dumps({**plan, "image_buckets": [[16, 28]]}))
    with pytest.raises(ValueError, match=r"image bucket \[16, 28\] is beyond"):
        image_plan("file", TOWER, bucket_file=path)
    path.write_text(json.dumps({**plan, "image_buckets": [[0, 28]]}))
    with pytest.raises(ValueError, match="is not two positive integers"):
        load_bucket_file(path)


@pytest.fixture(scope="module")
def next_dir(tmp_path_factory, smollm_dir):
    return build_tiny_llava_next(tmp_path_factory.mktemp("llava_next"), smollm_dir)


# a context bucket's warmup reaches position 2 x max_input_tokens: the tiny models have 512
LIMITS = dict(max_batch_size=4, max_input_tokens=256, max_total_tokens=288, max_prefill_tokens=512)
TRAFFIC = [  # tiles: 60x30 and 90x25 are 1x2 grids and a base tile (3), 40x40 a 2x2 grid (5)
    ["Describe: ", png_image(60, 30, 1)],
    ["Two: ", png_image(40, 40, 2), png_image(90, 25, 3)],
    ["Only text here"],
]


def test_record_fit_profile_and_serve_image_buckets(next_dir, tmp_path):
    """--record-shapes writes the tower's runs; a fitted plan on that trace plans image buckets
    for them; a warmup profile times each image bucket, and a shard served with the profile warms
    exactly its image buckets."""
    from engine.warmup.profile import measure, write_profile

    trace = tmp_path / "shapes.jsonl"
    shard = Shard(tiny_config(next_dir, record_shapes=str(trace), **LIMITS), show_progress=False)
    shard.warmup()
    run_requests(shard, [image_request(i, c, 3) for i, c in enumerate(TRAFFIC)])
    images = [s for s in load_shapes(trace) if s.phase == "image"]
    assert sorted(s.batch_size for s in images) in ([3, 8], [11])  # one batch or two
    assert {s.size for s in images} == {28}

    fitted = Shard(
        tiny_config(next_dir, bucket_strategy="fitted", bucket_shapes=str(trace), **LIMITS),
        show_progress=False,
    )
    fitted.warmup()
    counts = {b.count for b in fitted.runner.plan.images}
    assert {s.batch_size % 8 for s in images} - {0} <= counts and 8 in counts
    assert fitted.vision.planned == fitted.runner.plan.images

    entries = measure(fitted, 1)
    timed = [e for e in entries if e["phase"] == "image"]
    assert {(e["batch_size"], e["size"]) for e in timed} == {
        (b.count, b.size) for b in fitted.runner.plan.images
    }
    assert all(e["warm_s"] >= 0 and e["latency_s"] > 0 for e in timed)
    profile = write_profile(tmp_path / "profile", fitted, entries, "fitted", {})
    assert json.loads(profile.read_text())["image_buckets"]
    served = Shard(
        tiny_config(next_dir, warmup_profile=str(profile), **LIMITS), show_progress=False
    )
    served.warmup()
    assert set(served.vision.planned) == set(fitted.runner.plan.images)
    warmed = {b for b in served.adapter.shapes.warmed if b[0] == "vision"}
    assert warmed == {("vision", b.count, b.size) for b in fitted.runner.plan.images}


def test_strict_mode_refuses_an_image_no_warmed_bucket_holds(next_dir):
    """A model's own image shape key (here one that asks for a size never planned, as a
    dynamic-resolution model's key would for an image past its largest bucket) is refused
    before the tower runs, naming the image and the warmed image buckets."""
    shard = Shard(tiny_config(next_dir, **LIMITS), show_progress=False)
    shard.warmup()
    request = image_request(0, ["A: ", png_image(60, 30, 1)], 3)
    ids = shard.vision.prompt_ids(request)
    shard.vision.shape_key = lambda image: (1, 56)
    with pytest.raises(UnwarmedShapeError, match=r"60x30 pixels needs the vision tower at size 56"):
        shard.vision.encode(request, ids)
    assert shard.vision.stats["images_encoded"] == 0


# --- random traffic with images under --simulate hpu ----------------------------------------------

NEW_TOKENS = 5


@pytest.fixture(scope="module")
def vision_dirs(tiny_llava_dir, next_dir, tmp_path_factory, smollm_dir):
    from tests.test_vision_qwen2_5_vl import build_tiny_qwen2_5_vl

    return {
        "llava": tiny_llava_dir,
        "llava_next": next_dir,
        "qwen2_5_vl": build_tiny_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"), smollm_dir),
        "gemma3": build_tiny_gemma3(tmp_path_factory.mktemp("gemma3"), smollm_dir),
    }


@pytest.fixture(scope="module")
def shards(vision_dirs):
    """model -> (the shard under --simulate hpu, the same shard without the simulator)."""
    out = {}
    for name, model_dir in vision_dirs.items():
        pair = []
        for simulate in ("hpu", None):
            shard = Shard(tiny_config(model_dir, simulate=simulate, **LIMITS), show_progress=False)
            shard.warmup()
            pair.append(shard)
        out[name] = tuple(pair)
    return out


IMAGE = st.builds(  # few seeds: an image may come again, and its features are kept
    png_image, st.integers(8, 96), st.integers(8, 96), st.integers(0, 3)
)


def prompt(least_images: int):
    return st.lists(IMAGE, min_size=least_images, max_size=3).map(
        lambda images: [piece for image in images for piece in (image, " and ")] + ["what?"]
    )


PROMPTS = st.tuples(prompt(1), st.lists(prompt(0), max_size=3)).map(
    lambda drawn: [drawn[0], *drawn[1]]  # one prompt with images at least, text-only ones too
)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["llava", "llava_next", "qwen2_5_vl", "gemma3"])
@settings(
    max_examples=3,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(prompts=PROMPTS)
def test_random_traffic_with_images_runs_in_warmed_shapes(shards, model, prompts):
    simulated, plain = shards[model]
    longest = max(request_length(plain, image_request(0, list(c), 1)) for c in prompts)
    assume(longest <= LIMITS["max_input_tokens"])  # three large LLaVA-NeXT images may not fit
    tokens, seen = [], images_seen(simulated)
    for shard in (simulated, plain):
        requests = [image_request(i, list(c), NEW_TOKENS) for i, c in enumerate(prompts)]
        tokens.append({i: done.token_ids for i, done in run_requests(shard, requests).items()})
    stats = simulated.serving_stats()
    assert stats["unwarmed_shapes"] == 0 and plain.serving_stats()["unwarmed_shapes"] == 0
    assert stats["graph_compiles_serving"] == 0 and stats["graph_breaks_serving"] == 0
    assert tokens[0] == tokens[1]
    assert images_seen(simulated) > seen  # the traffic had images: encoded, or found kept


def images_seen(shard) -> int:
    return shard.vision.stats["images_encoded"] + shard.vision.stats["image_cache_hits"]
