"""Greedy tokens equal transformers' own generate on the same weights."""
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from launcher.generate import chat_prompt, generate
from engine.serving.shard import Shard
from tests.conftest import tiny_config

# Six prompts of clearly different lengths, decoded together in one mixed batch.
PROMPTS = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "Once upon a time, in a kingdom by the sea, there lived a princess who loved to read old maps.",
    "List three prime numbers:",
    "In 1969 the first humans walked on the moon. The mission was called Apollo 11 and it carried "
    "three astronauts: Neil Armstrong, Buzz Aldrin and Michael Collins, who stayed in orbit while "
    "the other two landed in the Sea of Tranquility.",
    "Water boils at",
]
NEW_TOKENS = 40  # > 2 blocks of 16: decode crosses block boundaries


def reference_tokens(model_dir, texts, max_new_tokens, add_special_tokens=True, stop_on_eos=False):
    """transformers' greedy generate, one prompt at a time (no padding in the reference)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not stop_on_eos:
        model.generation_config.eos_token_id = None
    outputs = []
    for text in texts:
        ids = tokenizer(text, return_tensors="pt", add_special_tokens=add_special_tokens)["input_ids"]
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens,
                                 do_sample=False, pad_token_id=0)
        outputs.append(out[0, ids.shape[1]:].tolist())
    return outputs


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
    prompts = ["What is the capital of France?", "Name three colors of the rainbow.",
               "Write one sentence about the sea.", "How many legs does a spider have?"]
    shard = Shard(tiny_config(smollm_dir), show_progress=False)
    ours = generate(shard, prompts, 32, chat=True)
    texts = [chat_prompt(shard.tokenizer, p) for p in prompts]
    expected = reference_tokens(smollm_dir, texts, 32, add_special_tokens=False, stop_on_eos=True)
    assert [c.token_ids for c in ours] == expected
    assert "Paris" in ours[0].text
