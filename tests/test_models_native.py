"""Greedy tokens of the native Qwen3, Qwen3-MoE, Mixtral, Gemma 2, Gemma 3 and Phi-3 equal
transformers' own generate on the same tiny random weights (fp32, strict shapes)."""

import pytest

from engine.serving.shard import Shard
from launcher.generate import generate
from tests.conftest import tiny_config
from tests.family_models import FAMILIES, WINDOW, family_dirs  # noqa: F401 (a fixture)
from tests.test_equivalence import NEW_TOKENS, PROMPTS, reference_tokens


@pytest.mark.parametrize("family", list(FAMILIES))
def test_native_family_matches_transformers(family_dirs, family):
    model_dir = family_dirs[family]
    shard = Shard(tiny_config(model_dir), show_progress=False)
    assert type(shard.model).__module__.startswith("engine.models")
    ours = generate(shard, PROMPTS, NEW_TOKENS, ignore_eos=True)
    expected = reference_tokens(model_dir, PROMPTS, NEW_TOKENS)
    lengths = [len(shard.tokenizer(p)["input_ids"]) for p in PROMPTS]
    assert max(lengths) > WINDOW  # prefill slides too, not only decode
    for completion, reference in zip(ours, expected):
        assert completion.token_ids == reference
    assert shard.adapter.shapes.strict and not shard.adapter.shapes.unwarmed
