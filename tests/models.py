"""Tiny random Llama-family models saved as Hugging Face directories, for exactness tests."""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# Each variant exercises a different part of the loader and model: GQA everywhere, llama3 rope
# scaling with untied embeddings, Mistral's config class, Qwen2's q/k/v biases with tied embeddings.
VARIANTS = {
    "llama": (
        "LlamaConfig",
        dict(
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 500000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            },
        ),
    ),
    "mistral": ("MistralConfig", dict(tie_word_embeddings=False, sliding_window=None)),
    "qwen2": ("Qwen2Config", dict(tie_word_embeddings=True)),
}


def build_tiny_model(
    variant: str,
    out_dir: Path,
    tokenizer_dir: Path,
    seed: int = 0,
    variants=None,
    randomize_norms: bool = False,
    **overrides,
) -> Path:
    import transformers

    config_name, extra = (variants or VARIANTS)[variant]
    shape = dict(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=512,
    )
    # A shape field set to None in a variant takes the config class's own default (Phi-3 has no head_dim).
    settings = {
        k: v for k, v in {**shape, **extra, **overrides}.items() if v is not None or k not in shape
    }
    config = getattr(transformers, config_name)(
        # A wider init than the default 0.02 keeps the top two logits apart, so greedy choices
        # are decided by the model, not by float rounding.
        initializer_range=0.2,
        bos_token_id=1,
        eos_token_id=2,
        **settings,
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    if randomize_norms:  # norms initialized to the identity would not show a misread norm weight
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "norm" in name:
                    param.uniform_(0.5, 1.5)
    model.save_pretrained(out_dir)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out_dir / name)
    return out_dir
