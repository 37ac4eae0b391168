"""Phi-3 past original_max_position_embeddings: greedy tokens equal transformers' generate when a
sequence crosses the boundary during decode (transformers then recomputes its whole cache with the
long factors) and when its prompt is already past it (rotated long from position 0). Both run in
one batch with strict shapes: the choice is per sequence."""

import pytest

from engine.errors import InvalidRequestError
from engine.serving.shard import Shard
from launcher.generate import generate
from tests.conftest import tiny_config
from tests.family_models import FAMILIES
from tests.models import build_tiny_model
from tests.test_equivalence import reference_tokens

ORIGINAL = 32
NEW_TOKENS = 24
SHORT = "The quick brown fox jumps over the lazy dog."  # ~11 tokens: crosses 32 during decode
LONG = (
    "Once upon a time, in a kingdom by the sea, there lived a princess who loved to read old maps. "
    "Every night she traced the coastlines by candlelight and dreamed of far islands."
)  # > 32 tokens


@pytest.fixture(scope="module")
def phi3_dir(tmp_path_factory, smollm_dir):
    config_name, extra = FAMILIES["phi3"]
    extra = {**extra, "original_max_position_embeddings": ORIGINAL, "max_position_embeddings": 256}
    return build_tiny_model(
        "phi3",
        tmp_path_factory.mktemp("phi3_long"),
        smollm_dir,
        variants={"phi3": (config_name, extra)},
        randomize_norms=True,
    )


def test_phi3_longrope_matches_transformers_across_the_boundary(phi3_dir):
    shard = Shard(tiny_config(phi3_dir), show_progress=False)
    lengths = [len(shard.tokenizer(p)["input_ids"]) for p in (SHORT, LONG)]
    assert lengths[0] < ORIGINAL < lengths[0] + NEW_TOKENS - 1 and lengths[1] > ORIGINAL
    ours = generate(shard, [SHORT, LONG], NEW_TOKENS, ignore_eos=True)
    expected = reference_tokens(phi3_dir, [SHORT, LONG], NEW_TOKENS)
    assert [c.token_ids for c in ours] == expected
    assert shard.adapter.shapes.strict and not shard.adapter.shapes.unwarmed


def test_the_recompute_must_fit_the_prefill_limits(phi3_dir):
    shard = Shard(tiny_config(phi3_dir), show_progress=False)
    with pytest.raises(
        InvalidRequestError, match=f"max_input_tokens must be at least {ORIGINAL + 1}"
    ):
        shard.warmup(
            max_input_tokens=16, max_total_tokens=64, max_prefill_tokens=16, max_batch_size=1
        )
