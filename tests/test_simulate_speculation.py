"""Speculative decoding under `--simulate hpu`: mixed traffic (every sampling field, grammar, n > 1,
stop sequences, prompt logprobs) through n-gram, draft-model and EAGLE-3 speculation meets only
warmed shapes and compiles and breaks no graph after warmup: the verify buckets, the draft's and
the head's own buckets and the target's aux-state writes are all warmed."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from launcher.check_shapes import replay_requests
from tests.helpers import PROMPTS, tiny_shard
from tests.models import build_tiny_model
from tests.test_simulate_serving import LIMITS, RECORDS
from tests.test_speculative_eagle3 import random_head

pytestmark = pytest.mark.slow
K = 3


@pytest.fixture(scope="module")
def speculating(tmp_path_factory, smollm_dir, tiny_model_dirs):
    """proposer -> a simulated-HPU shard speculating with it (built on first use)."""
    root = tmp_path_factory.mktemp("simulated-speculation")
    built = {}

    def options(method):
        if method == "ngram":
            return tiny_model_dirs["llama"], {}
        if method == "draft":
            draft = build_tiny_model("llama", root / "draft", smollm_dir, num_hidden_layers=1)
            return tiny_model_dirs["llama"], {"draft_model": str(draft)}
        target = build_tiny_model("llama", root / "target", smollm_dir, num_hidden_layers=3)
        return target, {"draft_model": str(random_head(root / "head", [0, 1, 2]))}

    def get(method):
        if method not in built:
            target, extra = options(method)
            built[method] = tiny_shard(
                target,
                simulate="hpu",
                speculate=method,
                num_speculative_tokens=K,
                **extra,
                **LIMITS,
            )
        return built[method]

    yield get
    for shard in built.values():
        shard.clear()


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle3"])
@settings(
    max_examples=2,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(records=RECORDS, longer=st.integers(6, 14))
def test_speculating_traffic_compiles_and_breaks_nothing_after_warmup(
    speculating, method, records, longer
):
    """The plain traffic test's records, generating `longer` more tokens each, so that rows
    reach their verify steps."""
    shard = speculating(method)
    records = [{**r, "max_new_tokens": r["max_new_tokens"] + longer} for r in records]
    assert replay_requests(shard, records) == []
    stats = shard.serving_stats()
    assert stats["graph_compiles_serving"] == 0
    assert stats["graph_breaks_serving"] == 0
    assert not shard.adapter.shapes.unwarmed


@pytest.mark.parametrize("method", ["ngram", "draft", "eagle3"])
def test_verify_steps_run_in_warmed_graphs(speculating, method):
    """Greedy rows of every prompt, admitted one a step: speculation runs, and compiles nothing."""
    shard = speculating(method)
    before = dict(shard.speculator.stats)
    records = [{"prompt": p, "max_new_tokens": 24, "parameters": {}} for p in PROMPTS[:4]]
    assert replay_requests(shard, records) == []
    stats = shard.serving_stats()
    assert stats["spec_steps"] > before["spec_steps"]
    assert stats["spec_proposed"] > before["spec_proposed"]
    assert stats["graph_compiles_serving"] == 0
    assert stats["graph_breaks_serving"] == 0
