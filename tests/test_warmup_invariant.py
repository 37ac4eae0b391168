"""After warmup, random traffic within the limits never reaches the device at an unwarmed shape:
for every bucket strategy, a profile's buckets, and progressive warmup while it is still warming."""

from __future__ import annotations

import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine.batch import Batch, Request
from engine.buckets.shapes import Shape
from engine.serving.shard import Shard
from tests.conftest import tiny_config
from tests.helpers import build_request

# Small limits keep warmup short: 4 rows, prompts up to 48 tokens, 6 blocks of 16 per sequence.
LIMITS = dict(
    max_batch_size=4,
    max_input_tokens=48,
    max_total_tokens=96,
    max_prefill_tokens=96,
    warmup_prompt_logprobs=False,
    strict_shapes=False,
)  # lenient: count, not raise
TRAFFIC = settings(
    max_examples=4, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
SETUPS = ["linear", "exponential", "padding", "fitted", "file", "progressive"]


def trace_file(path, seed=0) -> str:
    rng = random.Random(seed)
    lines = []
    for _ in range(60):
        b = rng.randint(1, 4)
        lines.append(Shape("prefill", b, rng.randint(1, 48)))
        lines.append(Shape("decode", b, rng.randint(b, 6 * b)))
    path.write_text("".join(json.dumps(s.as_json()) + "\n" for s in lines))
    return str(path)


def setup_config(name: str, model_dir, tmp_path):
    if name == "fitted":
        return tiny_config(
            model_dir,
            **LIMITS,
            bucket_strategy="fitted",
            max_graphs=8,
            bucket_shapes=trace_file(tmp_path / "trace.jsonl"),
        )
    if name == "file":  # a deliberately sparse plan: most batches must be split
        path = tmp_path / "buckets.json"
        path.write_text(
            json.dumps({"prefill_buckets": [[1, 48], [4, 16]], "decode_buckets": [[1, 6], [4, 24]]})
        )
        return tiny_config(model_dir, **LIMITS, bucket_strategy="file", bucket_file=str(path))
    if name == "progressive":
        return tiny_config(model_dir, **LIMITS, warmup_mode="progressive")
    return tiny_config(model_dir, **LIMITS, bucket_strategy=name)


@pytest.fixture(scope="module")
def shards(tiny_model_dirs, tmp_path_factory):
    """name -> a shard on the tiny Llama (loaded once per setup, warmed on first use)."""
    built = {}

    def get(name):
        if name not in built:
            built[name] = Shard(
                setup_config(name, tiny_model_dirs["llama"], tmp_path_factory.mktemp(name)),
                show_progress=False,
            )
            built[name].warmup()
        return built[name]

    yield get
    for shard in built.values():
        shard._stop_background_warmup()


def request(rid: int, prompt_len: int, new_tokens: int) -> Request:
    # truncate keeps the last prompt_len tokens: exact lengths whatever the tokenizer does.
    return build_request(rid, new_tokens, "word " * 60, truncate=prompt_len)


def serve_random_traffic(shard: Shard, data) -> int:
    """Prefills of random sizes and lengths joining a running decode batch, as a router sends them;
    returns the number of tokens generated."""
    cached, running, next_id, tokens = None, 0, 0, 0
    for _ in range(data.draw(st.integers(1, 5), label="waves")):
        size = data.draw(st.integers(1, 4 - running), label="prefill size") if running < 4 else 0
        if size:
            requests = []
            for _ in range(size):
                length = data.draw(st.integers(1, 48), label="prompt")
                requests.append(
                    request(
                        next_id,
                        length,
                        data.draw(st.integers(1, min(12, 96 - length)), label="new"),
                    )
                )
                next_id += 1
            generations, new = shard.prefill(Batch(next_id, requests))
            tokens += len(generations)
            if new is not None:
                generations, cached = shard.decode([cached, new] if cached is not None else [new])
                tokens += len(generations)
        for _ in range(data.draw(st.integers(0, 6), label="decode steps")):
            if cached is not None:
                generations, cached = shard.decode([cached])
                tokens += len(generations)
        running = len(cached.request_ids) if cached is not None else 0
    shard.clear()
    return tokens


@pytest.mark.parametrize("setup", SETUPS)
@TRAFFIC
@given(data=st.data())
def test_random_traffic_never_meets_an_unwarmed_shape(shards, setup, data):
    shard = shards(setup)
    if setup == "progressive":
        shard.warmup()  # again: the traffic below runs while the background warms
    assert serve_random_traffic(shard, data) > 0
    assert sum(shard.adapter.shapes.unwarmed.values()) == 0, shard.adapter.shapes.unwarmed
    assert shard.allocator.num_free == shard.allocator.num_blocks - 1


def test_file_plan_is_warmed_exactly(shards):
    shard = shards("file")
    warmed = {
        shape[1] for shape in shard.adapter.shapes.warmed if shape[0] in ("prefill", "decode")
    }
    planned = set(shard.runner.plan.prefill + shard.runner.plan.decode)
    assert planned == {b.bucket for b in shard.warmup_log.buckets} and planned <= warmed
