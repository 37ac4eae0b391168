"""Phi-3's rope switch under `--simulate hpu`: the decode step at which one sequence's cache is
recomputed by a prefill, next to a sequence that decodes as usual, merges the two forwards' rows at
the plan's shapes (engine/serving/recompute.py): no serving compile, no graph break, and the greedy
tokens of the plain CPU shard."""

from __future__ import annotations

import pytest

from launcher.generate import generate
from tests.helpers import tiny_shard
from tests.test_models_longrope import (
    LONG,
    NEW_TOKENS,
    ORIGINAL,
    SHORT,
    phi3_dir,  # noqa: F401 - the fixture
)

pytestmark = pytest.mark.slow
LIMITS = dict(max_batch_size=2, max_input_tokens=48, max_total_tokens=80, max_prefill_tokens=96)


def test_the_recompute_step_compiles_nothing_and_keeps_the_tokens(phi3_dir):  # noqa: F811
    simulated = tiny_shard(phi3_dir, simulate="hpu", **LIMITS)
    lengths = [len(simulated.tokenizer(p)["input_ids"]) for p in (SHORT, LONG)]
    assert lengths[0] < ORIGINAL < lengths[0] + NEW_TOKENS - 1 and lengths[1] > ORIGINAL
    ours = generate(simulated, [SHORT, LONG], NEW_TOKENS, ignore_eos=True)
    stats = simulated.serving_stats()
    assert stats["graph_compiles_serving"] == 0 and stats["graph_breaks_serving"] == 0
    plain = tiny_shard(phi3_dir, **LIMITS)
    expected = generate(plain, [SHORT, LONG], NEW_TOKENS, ignore_eos=True)
    assert [c.token_ids for c in ours] == [c.token_ids for c in expected]
