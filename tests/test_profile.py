"""warmup-profile writes profile.json and plots; a shard reuses exactly its buckets, or refuses a foreign one."""

from __future__ import annotations

import json

import pytest

from engine.cli.main import main
from engine.serving.shard import Shard
from tests.conftest import tiny_config
from tests.test_warmup_invariant import trace_file

# Four rows: eager CPU adds a decode bucket for 3 rows, whose blocks must stay within what 3
# sequences hold for the profile to load.
LIMIT_ARGS = [
    "--max-batch-size",
    "4",
    "--max-input-tokens",
    "32",
    "--max-total-tokens",
    "64",
    "--max-prefill-tokens",
    "64",
    "--block-size",
    "16",
]
PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def profile(tiny_model_dirs, tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    trace = trace_file(out / "trace.jsonl")
    code = main(
        [
            "warmup-profile",
            "--model-id",
            str(tiny_model_dirs["llama"]),
            "--device",
            "cpu",
            "--dtype",
            "float32",
            *LIMIT_ARGS,
            "--shapes",
            trace,
            "--runs",
            "2",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    return out / "profile.json"


def config(tiny_model_dirs, path, **overrides):
    limits = dict(max_batch_size=4, max_input_tokens=32, max_total_tokens=64, max_prefill_tokens=64)
    return tiny_config(
        tiny_model_dirs["llama"], **{**limits, **overrides}, warmup_profile=str(path)
    )


def test_profile_has_per_bucket_figures_fingerprint_and_plots(profile):
    data = json.loads(profile.read_text())
    assert data["fingerprint"]["device"] == "cpu" and data["fingerprint"]["block_size"] == 16
    assert data["strategy"] == "exponential"
    assert len(data["buckets"]) == len(data["prefill_buckets"]) + len(data["decode_buckets"]) > 0
    for entry in data["buckets"]:
        assert entry["warm_s"] > 0 and entry["latency_s"] > 0 and len(entry["latency_runs_s"]) == 2
        assert min(entry["latency_runs_s"]) <= entry["latency_s"] <= max(entry["latency_runs_s"])
    assert {r["strategy"] for r in data["strategy_waste"]} == {
        "linear",
        "exponential",
        "padding",
        "fitted",
    }
    for name in ("prefill_latency.png", "decode_latency.png", "strategy_waste.png"):
        assert (profile.parent / name).read_bytes()[:8] == PNG


def test_serving_with_the_profile_warms_exactly_its_buckets(tiny_model_dirs, profile):
    data = json.loads(profile.read_text())
    shard = Shard(config(tiny_model_dirs, profile, bucket_strategy="linear"), show_progress=False)
    shard.warmup()
    warmed = {b.bucket for b in shard.warmup_log.buckets}
    as_pairs = {
        (
            type(b).__name__,
            b.batch_size,
            getattr(b, "seq_len", getattr(b, "num_blocks", None)),
            *([b.context_blocks] if hasattr(b, "context_blocks") else []),
        )
        for b in warmed
    }  # prefill: with context
    listed = {("PrefillBucket", *p) for p in data["prefill_buckets"]} | {
        ("DecodeBucket", *p) for p in data["decode_buckets"]
    }
    assert as_pairs == listed  # the profile's buckets, not the linear strategy's
    assert shard.runner.plan.latency is not None and set(shard.runner.plan.latency) == warmed


def test_a_profile_from_another_setup_is_refused_clearly(
    tiny_model_dirs, profile, tmp_path, capsys
):
    data = json.loads(profile.read_text())
    data["fingerprint"]["dtype"] = "bfloat16"
    foreign = tmp_path / "profile.json"
    foreign.write_text(json.dumps(data))
    shard = Shard(config(tiny_model_dirs, foreign), show_progress=False)
    with pytest.raises(
        ValueError, match=r"measured on another setup: dtype='bfloat16' \(this shard: 'float32'\)"
    ):
        shard.warmup()


def test_a_profile_whose_buckets_exceed_the_limits_is_refused(tiny_model_dirs, profile):
    shard = Shard(config(tiny_model_dirs, profile, max_batch_size=1), show_progress=False)
    with pytest.raises(ValueError, match="limits differ from the profile's.*beyond the limits"):
        shard.warmup()


def test_the_summary_table_names_each_prefill_buckets_context():
    from engine.warmup.profile import summary_table

    figures = {"warm_s": 0.5, "latency_s": 0.002, "memory_bytes": 0}
    entries = [
        {"phase": "prefill", "batch_size": 1, "seq_len": 48, "context_blocks": ctx, **figures}
        for ctx in (0, 2, 4)
    ] + [{"phase": "decode", "batch_size": 2, "num_blocks": 8, **figures}]
    header, *rows, _ = summary_table(entries).splitlines()
    assert header.split()[3:5] == ["ctx", "blocks"]
    assert len(set(rows)) == len(rows)  # no two buckets print the same line
    assert [row.split()[3] for row in rows] == ["0", "2", "4", "-"]
