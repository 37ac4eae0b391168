"""Greedy tokens equal transformers' own generate on the same weights."""

import pytest

from engine.serving.shard import Shard
from launcher.generate import chat_prompt, generate
from tests.conftest import tiny_config
from tests.helpers import PROMPTS, reference_tokens  # other modules import them from here too

NEW_TOKENS = 40  # > 2 blocks of 16: decode crosses block boundaries


@pytest.mark.parametrize("variant", ["llama", "mistral", "qwen2"])
def test_tiny_models_match_transformers(tiny_model_dirs, variant):
    model_dir = tiny_model_dirs[variant]
    shard = Shard(tiny_config(model_dir), show_progress=False)
    ours = generate(shard, PROMPTS, NEW_TOKENS, ignore_eos=True)
    expected = reference_tokens(model_dir, PROMPTS, NEW_TOKENS)
    lengths = [len(shard.tokenizer(p)["input_ids"]) for p in PROMPTS]
    assert len(set(lengths)) == len(PROMPTS)  # really a mixed batch
    for completion, reference in zip(ours, expected):
        assert len(completion.token_ids) == NEW_TOKENS
        assert completion.token_ids == reference
    assert shard.adapter.shapes.strict and not shard.adapter.shapes.unwarmed


@pytest.mark.slow
def test_embedded_model_matches_transformers_on_chat(smollm_dir):
    prompts = [
        "What is the capital of France?",
        "Name three colors of the rainbow.",
        "Write one sentence about the sea.",
        "How many legs does a spider have?",
    ]
    shard = Shard(tiny_config(smollm_dir), show_progress=False)
    ours = generate(shard, prompts, 32, chat=True)
    texts = [chat_prompt(shard.tokenizer, p) for p in prompts]
    expected = reference_tokens(smollm_dir, texts, 32, add_special_tokens=False, stop_on_eos=True)
    assert [c.token_ids for c in ours] == expected
    assert "Paris" in ours[0].text
