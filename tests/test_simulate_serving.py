"""Serving under `--simulate hpu` on a tiny model: mixed traffic after warmup compiles and breaks
no graph, greedy tokens equal the plain CPU shard's, `--warmup none` counts compiles, and
`bucketserve check-shapes` names a shape outside the plan."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher.check_shapes import replay_requests
from tests.helpers import PROMPTS, tiny_shard

pytestmark = pytest.mark.slow
LIMITS = dict(max_batch_size=4, max_input_tokens=64, max_total_tokens=128, max_prefill_tokens=128)
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def simulated(tiny_model_dirs):
    return tiny_shard(tiny_model_dirs["llama"], simulate="hpu", block_size=16, **LIMITS)


PARAMETERS = st.fixed_dictionaries(
    {},
    optional={
        "temperature": st.sampled_from([0.5, 1.3]),
        "top_k": st.sampled_from([1, 5, 40]),
        "top_p": st.sampled_from([0.5, 0.95]),
        "typical_p": st.sampled_from([0.6]),
        "repetition_penalty": st.sampled_from([1.2, 0.8]),
        "frequency_penalty": st.sampled_from([0.3]),
        "presence_penalty": st.sampled_from([0.5]),
        "logit_bias": st.sampled_from([{"3": 2.0, "17": -5.0}]),
        "watermark": st.just(True),
        "seed": st.integers(0, 2**32),
    },
)
RECORDS = st.lists(
    st.fixed_dictionaries(
        {
            "prompt": st.sampled_from(PROMPTS),
            "max_new_tokens": st.integers(1, 6),
            "parameters": PARAMETERS,
        },
        optional={
            "top_n_tokens": st.integers(1, 5),
            "stop": st.just(["the"]),
            "grammar": st.sampled_from(
                [
                    {"type": "regex", "value": "[a-z ]+"},
                    {"type": "json", "value": '{"type": "string"}'},
                ]
            ),
        },
    ),
    min_size=1,
    max_size=6,
)


@settings(
    max_examples=4,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(records=RECORDS)
def test_mixed_traffic_compiles_and_breaks_nothing_after_warmup(simulated, records):
    problems = replay_requests(simulated, records)
    stats = simulated.serving_stats()
    assert problems == []
    assert stats["graph_compiles_serving"] == 0
    assert stats["graph_breaks_serving"] == 0


def _greedy_tokens(shard, count: int) -> list[list[int]]:
    records = [{"prompt": p, "max_new_tokens": 5} for p in PROMPTS[:count]]
    tokens = {}
    original = shard.decode

    def decode(batches, *args, **kwargs):
        gens, cached = original(batches, *args, **kwargs)
        for g in gens:
            tokens.setdefault(g.request_id, []).extend(g.tokens.ids)
        return gens, cached

    shard.decode = decode
    try:
        assert replay_requests(shard, records) == []
    finally:
        del shard.decode
    return [tokens.get(i, []) for i in range(count)]


def test_greedy_tokens_equal_the_plain_cpu_shard(simulated, tiny_model_dirs):
    plain = tiny_shard(tiny_model_dirs["llama"], block_size=16, **LIMITS)
    assert _greedy_tokens(simulated, 3) == _greedy_tokens(plain, 3)


def test_warmup_none_counts_every_first_shape(tiny_model_dirs):
    shard = tiny_shard(
        tiny_model_dirs["llama"], simulate="hpu", block_size=16, warmup_mode="none", **LIMITS
    )
    records = [{"prompt": PROMPTS[1], "max_new_tokens": 3, "parameters": {"top_k": 5}}]
    problems = replay_requests(shard, records)
    assert shard.serving_stats()["graph_compiles_serving"] > 0
    assert any("compile" in line for line in problems)


def _check_shapes(model_dir, trace: Path, *extra: str):
    args = ["--model-id", str(model_dir), "--dtype", "float32", "--block-size", "16"]
    limits = [f"--{k.replace('_', '-')}={v}" for k, v in LIMITS.items()]
    code = "import sys; from launcher.cli import bucketserve; sys.exit(bucketserve(sys.argv[1:]))"
    command = [sys.executable, "-c", code, "check-shapes", *args, *limits, "--trace", str(trace)]
    return subprocess.run(
        command + list(extra), capture_output=True, text=True, cwd=REPO, timeout=600
    )


def test_check_shapes_names_a_shape_outside_the_plan(tiny_model_dirs, tmp_path):
    trace = tmp_path / "trace.jsonl"
    shapes = [
        {"phase": "prefill", "batch_size": 1, "seq_len": 40},
        {"phase": "decode", "batch_size": 3, "num_blocks": 6},
        {"phase": "decode", "batch_size": 9, "num_blocks": 20},  # more rows than any bucket
    ]
    trace.write_text("".join(json.dumps(s) + "\n" for s in shapes))
    result = _check_shapes(tiny_model_dirs["llama"], trace)
    assert result.returncode != 0, result.stdout
    assert "line 3" in result.stdout and '"batch_size": 9' in result.stdout
    assert "line 1 " not in result.stdout and "line 2 " not in result.stdout


def test_check_shapes_on_the_chat_example(smollm_dir, tmp_path):
    """The example's first steps, at the limits it was recorded for (a tiny model long enough):
    what it reports is the one shape not yet static, a prefill split in several buckets (its
    rows are stacked: docs/devices.md); nothing else compiles and nothing breaks."""
    from tests.models import build_tiny_model

    model = build_tiny_model("llama", tmp_path / "long", smollm_dir, max_position_embeddings=2048)
    trace = REPO / "examples" / "shapes_chat_mixed.jsonl"
    result = _check_shapes(
        model,
        trace,
        "--max-batch-size=32",
        "--max-input-tokens=1024",
        "--max-total-tokens=2048",
        "--max-prefill-tokens=4096",
        "--limit=40",
    )
    problems = [line for line in result.stdout.splitlines() if line.startswith("line ")]
    assert result.returncode == (2 if problems else 0), result.stderr
    assert all('"phase": "prefill"' in line and "in prefill" in line for line in problems)
    assert "graph_breaks_serving=0" in result.stdout
