"""Mixed traffic through the router's real scheduler to a `--graph-mode compile` shard on CPU
(inductor, strict shapes, warmed at the scheduler's limits): sampling fields, top-n tokens, prompt
logprobs, JSON and regex grammars, `n` siblings, stop sequences and a shared prefix (a prefix-cache
hit). Torch's own counters (engine/devices/dynamo.py) show no graph compiled, recompiled or broken
after warmup, and greedy requests get the eager shard's tokens. A prompt longer than the warmed
buckets is refused, not compiled. Few buckets (batch 2, 32 tokens): each one is an inductor
compile of seconds."""

from __future__ import annotations

import pytest

from engine.config import ServingLimits
from tests.helpers import PROMPTS, shard_options, tiny_shard
from tests.test_simulate_traffic_router import serve

pytestmark = pytest.mark.slow
BLOCK = 16
LIMITS = ServingLimits(
    max_batch_size=2, max_prefill_tokens=32, max_input_tokens=32, max_total_tokens=48
)
SHARD = shard_options(LIMITS, BLOCK)
SHARED = "The moon landing was in 1969 and the crew came home after eight days. "  # a full block
WAVES = [
    [
        {"prefix": None, "tail": SHARED + "Then", "max_new_tokens": 6, "parameters": {},
         "top_n_tokens": 3},
        {"prefix": None, "tail": PROMPTS[1], "max_new_tokens": 5, "stop": ["the"],
         "parameters": {"repetition_penalty": 1.2, "frequency_penalty": 0.3,
                        "presence_penalty": 0.5, "logit_bias": {3: 2.0}}},
        {"prefix": None, "tail": PROMPTS[2], "max_new_tokens": 5, "grammar": "json",
         "parameters": {"temperature": 1.3, "top_k": 40, "top_p": 0.95, "typical_p": 0.6,
                        "seed": 7, "watermark": True}},
        {"prefix": None, "tail": PROMPTS[3], "max_new_tokens": 4, "n": 2,
         "prefill_logprobs": True, "parameters": {"repetition_penalty": 1.2}},
    ],
    [
        {"prefix": None, "tail": SHARED + "Later", "max_new_tokens": 5, "grammar": "regex",
         "parameters": {}},
        {"prefix": None, "tail": PROMPTS[4][:60], "max_new_tokens": 4,
         "parameters": {"temperature": 0.5, "seed": 3, "top_k": 5}},
    ],
]  # fmt: skip


@pytest.fixture(scope="module")
def shards(tiny_model_dirs):
    model_dir = tiny_model_dirs["llama"]
    compiled = tiny_shard(model_dir, warmup=LIMITS, graph_mode="compile", **SHARD)
    eager = tiny_shard(model_dir, warmup=LIMITS, **SHARD)
    return compiled, eager


def test_mixed_traffic_compiles_nothing_after_warmup_and_keeps_greedy_tokens(shards):
    compiled, eager = shards
    warmed = compiled.serving_stats()
    assert warmed["graph_compiles_warmup"] > 0  # torch compiled every bucket during warmup
    tokens, errors, scheduler = serve(compiled, WAVES)
    assert errors == {}
    stats = compiled.serving_stats()
    for kind in ("compiles", "recompiles", "breaks"):
        assert stats[f"graph_{kind}_serving"] == 0, stats
    assert stats["unwarmed_shapes"] == 0
    assert scheduler.allocator.stats.hit_requests > 0  # the shared block was found cached
    expected, eager_errors, _ = serve(eager, WAVES)
    assert eager_errors == {}
    greedy = {i: ids for i, (sampled, ids) in expected.items() if not sampled}
    assert greedy and {i: tokens[i][1] for i in greedy} == greedy
