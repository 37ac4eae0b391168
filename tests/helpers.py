"""What many test modules build the same way: a tiny shard, transformers' reference tokens, and
an engine `Request`.

A module states only its own values; the fixture factories turn them into module fixtures:

    shard = shard_fixture(max_batch_size=4, warmup=LIMITS)
    expected = reference_fixture(PROMPTS, NEW_TOKENS)
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine.batch import NextTokenChooserParameters, Request, StoppingCriteriaParameters
from engine.config import EngineConfig, ServingLimits

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


# --- the tiny shard ------------------------------------------------------------------------------


def tiny_config(model_dir, **overrides) -> EngineConfig:
    """A small, strict shard config; `overrides` are EngineConfig fields."""
    # float32: these shards are compared with transformers in float32 (--dtype auto may pick
    # bfloat16)
    settings = dict(
        model_id=str(model_dir),
        device="cpu",
        dtype="float32",
        block_size=16,
        max_batch_size=8,
        max_input_tokens=128,
        max_total_tokens=256,
        max_prefill_tokens=512,
        strict_shapes=True,
    )
    return EngineConfig(**{**settings, **overrides})


def shard_options(limits: ServingLimits, block_size: int) -> dict:
    """The shard config fields that plan its buckets for `limits`, with KV blocks of `block_size`."""
    return dict(
        block_size=block_size,
        max_batch_size=limits.max_batch_size,
        max_prefill_tokens=limits.max_prefill_tokens,
        max_input_tokens=limits.max_input_tokens,
        max_total_tokens=limits.max_total_tokens,
    )


def tiny_shard(model_dir, *, warmup: bool | ServingLimits = True, **overrides):
    """A shard on `model_dir` with `tiny_config(model_dir, **overrides)`.

    warmup: True warms it for the config's own limits; ServingLimits warms it for those (as a
    router's Warmup does); False leaves it cold, for a test whose router or server warms it."""
    from engine.serving.shard import Shard

    shard = Shard(tiny_config(model_dir, **overrides), show_progress=False)
    if isinstance(warmup, ServingLimits):
        shard.warmup(
            warmup.max_input_tokens,
            warmup.max_prefill_tokens,
            warmup.max_total_tokens,
            warmup.max_batch_size,
        )
    elif warmup:
        shard.warmup()
    return shard


def warmed_llama_shard(tiny_model_dirs):
    """A warmed shard on the tiny Llama, batch size 4 (each test module builds its own)."""
    return tiny_shard(tiny_model_dirs["llama"], max_batch_size=4)


def shard_fixture(variant: str = "llama", *, warmup: bool | ServingLimits = True, **overrides):
    """A module fixture: `tiny_shard` on the tiny `variant`; its batches are cleared after the
    module."""

    @pytest.fixture(scope="module")
    def shard(tiny_model_dirs):
        built = tiny_shard(tiny_model_dirs[variant], warmup=warmup, **overrides)
        yield built
        built.clear()

    return shard


# --- transformers' reference tokens --------------------------------------------------------------

_references: dict[tuple, list[list[int]]] = {}


def reference_tokens(model_dir, texts, max_new_tokens, add_special_tokens=True, stop_on_eos=False):
    """transformers' greedy generate, one prompt at a time (no padding in the reference).

    Remembered for the session: several modules ask for the same prompts on the same weights,
    and each answer costs a model load and a generate per prompt."""
    key = (_weights_key(model_dir), tuple(texts), max_new_tokens, add_special_tokens, stop_on_eos)
    if key not in _references:
        _references[key] = _generate_reference(
            model_dir, texts, max_new_tokens, add_special_tokens, stop_on_eos
        )
    return [list(tokens) for tokens in _references[key]]  # a copy: a test may change its lists


def _weights_key(model_dir) -> tuple:
    """The directory and its files' sizes and times: a model rewritten in place is not taken for
    the old one."""
    files = sorted(p for p in Path(model_dir).iterdir() if p.is_file())
    return (
        str(Path(model_dir).resolve()),
        tuple((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files),
    )


def _generate_reference(model_dir, texts, max_new_tokens, add_special_tokens, stop_on_eos):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if not stop_on_eos:
        model.generation_config.eos_token_id = None
    outputs = []
    for text in texts:
        encoded = tokenizer(text, return_tensors="pt", add_special_tokens=add_special_tokens)
        ids = encoded["input_ids"]
        with torch.inference_mode():
            out = model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                pad_token_id=0,
            )
        outputs.append(out[0, ids.shape[1] :].tolist())
    return outputs


def reference_fixture(texts, max_new_tokens, variant: str = "llama", **options):
    """A module fixture: `reference_tokens` of `texts` on the tiny `variant`."""

    @pytest.fixture(scope="module")
    def expected(tiny_model_dirs):
        return reference_tokens(tiny_model_dirs[variant], texts, max_new_tokens, **options)

    return expected


# --- requests ------------------------------------------------------------------------------------


def build_request(
    i: int,
    max_new_tokens: int,
    text: str | None = None,
    *,
    parameters: NextTokenChooserParameters | None = None,
    ignore_eos_token: bool = True,
    **fields,
) -> Request:
    """Request `i` for PROMPTS[i] (or `text`): greedy unless `parameters` say otherwise, and
    `max_new_tokens` long whatever EOS says; `fields` are the Request's others (blocks, slots,
    adapter_id, cache_len, truncate, ...)."""
    stopping = StoppingCriteriaParameters(
        max_new_tokens=max_new_tokens, ignore_eos_token=ignore_eos_token
    )
    return Request(
        i,
        PROMPTS[i] if text is None else text,
        parameters=NextTokenChooserParameters() if parameters is None else parameters,
        stopping_parameters=stopping,
        **fields,
    )
