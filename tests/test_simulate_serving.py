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

from engine.buckets.shapes import parse_shape
from launcher.check_shapes import SIBLINGS, replay_requests, replay_shapes
from tests.helpers import PROMPTS, tiny_shard
from tests.test_lora import lora_dirs  # noqa: F401 - the fixture

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
            "prefill_logprobs": st.just(True),
            "n": st.integers(2, 3),
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


def test_batches_over_several_buckets_and_after_context_compile_nothing(simulated):
    """A batch larger than every bucket runs in several (a prefill of 4 x 60 tokens, 240 tokens
    for a budget of 128; a decode of 40 blocks), and rows after cached context (a prefix-cache hit,
    a prompt's next chunk) run in context buckets: their rows are merged at the plan's shapes."""
    shapes = [
        {"phase": "prefill", "batch_size": 4, "seq_len": 60},
        {"phase": "prefill", "batch_size": 2, "seq_len": 16, "context_blocks": 2},
        {"phase": "prefill", "batch_size": 1, "seq_len": 16, "context_blocks": 2},
        {"phase": "decode", "batch_size": 4, "num_blocks": 40},
    ]
    assert replay_shapes(simulated, [parse_shape(json.dumps(s)) for s in shapes]) == []
    assert simulated.serving_stats()["graph_compiles_serving"] == 0


@pytest.fixture(scope="module")
def plain(tiny_model_dirs):
    return tiny_shard(tiny_model_dirs["llama"], block_size=16, **LIMITS)


def _generations(shard, records: list[dict]) -> dict:
    """request id -> its generations, prefill's first, from replaying `records`."""
    generations = {}

    def recording(name):
        original = getattr(shard, name)

        def step(*args, **kwargs):
            gens, cached = original(*args, **kwargs)
            for g in gens:
                generations.setdefault(g.request_id, []).append(g)
            return gens, cached

        return step

    shard.prefill, shard.decode = recording("prefill"), recording("decode")
    try:
        assert replay_requests(shard, records) == []
    finally:
        del shard.prefill, shard.decode
    return generations


def _greedy_tokens(shard, count: int) -> list[list[int]]:
    records = [{"prompt": p, "max_new_tokens": 5} for p in PROMPTS[:count]]
    generations = _generations(shard, records)
    return [[t for g in generations[i * SIBLINGS] for t in g.tokens.ids] for i in range(count)]


def test_greedy_tokens_equal_the_plain_cpu_shard(simulated, plain):
    assert _greedy_tokens(simulated, 3) == _greedy_tokens(plain, 3)


def test_prompt_logprobs_are_scored_inside_the_graph(simulated, plain):
    """One logprob per prompt token out of the prefill's graph, whatever the prompts' lengths,
    equal to the plain CPU shard's (scored there outside any graph)."""
    records = [
        {"prompt": p, "max_new_tokens": 2, "prefill_logprobs": True, "top_n_tokens": 2}
        for p in PROMPTS[:3]
    ]
    scored = [_generations(shard, records) for shard in (simulated, plain)]
    assert simulated.serving_stats()["graph_compiles_serving"] == 0
    for i, prompt in enumerate(PROMPTS[:3]):
        simulated_logprobs, plain_logprobs = (
            g[i * SIBLINGS][0].prefill_tokens.logprobs for g in scored
        )
        assert len(simulated_logprobs) == len(plain.tokenizer(prompt)["input_ids"])
        assert simulated_logprobs[1:] == pytest.approx(plain_logprobs[1:], rel=1e-4, abs=1e-4)


def test_siblings_copy_their_prompt_in_warmed_graphs(simulated, plain):
    """`n` > 1: each sibling's prompt KV is copied from its source's (fixed-width pieces) and its
    first token sampled from the source's row; greedy siblings match the plain CPU shard's."""
    records = [
        {"prompt": PROMPTS[0], "max_new_tokens": 3, "n": 3},
        {"prompt": PROMPTS[2], "max_new_tokens": 2, "n": 2, "parameters": {"top_k": 5}},
    ]
    generations = [_generations(shard, records) for shard in (simulated, plain)]
    stats = simulated.serving_stats()
    assert stats["copied_prompts"] > 0
    assert stats["graph_compiles_serving"] == 0 and stats["graph_breaks_serving"] == 0
    tokens = [
        {i: [t for g in gens for t in g.tokens.ids] for i, gens in run.items()}
        for run in generations
    ]
    assert tokens[0][1] == tokens[0][2] == tokens[0][0] == tokens[1][0]


def test_lora_traffic_compiles_nothing(tiny_model_dirs, lora_dirs):
    """Rows of two LoRA adapters and the base model, in any mix: one graph per bucket."""
    specs = tuple((name, str(path)) for name, path in lora_dirs.items())
    shard = tiny_shard(
        tiny_model_dirs["llama"], simulate="hpu", block_size=16, lora_adapters=specs, **LIMITS
    )
    records = [
        {"prompt": p, "max_new_tokens": 3, "adapter": a}
        for p, a in zip(PROMPTS, ["alpha", None, "beta", "alpha", "beta"])
    ]
    assert replay_requests(shard, records) == []
    stats = shard.serving_stats()
    assert stats["graph_compiles_serving"] == 0 and stats["graph_breaks_serving"] == 0


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
    prefills split over several buckets among them, every step runs in warmed graphs."""
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
    assert problems == [] and result.returncode == 0, result.stdout + result.stderr
    assert "graph_compiles_serving=0 " in result.stdout
    assert "graph_breaks_serving=0" in result.stdout
