"""Decode steps whose sequences must be recomputed instead of extended.

A model may name a position at which its reference implementation throws the sequence's KV cache
away and recomputes it (Phi-3's longrope: engine/models/phi3.py). The decode step that would feed
that position runs those sequences as a prefill of their whole token list instead (same slots, so
the cache is overwritten in place), and the others decode as usual; their logits come back in
order. The decision reads host state only (token counts), never a device value. Where graphs
compile, the two forwards' rows are merged at the plan's shapes (engine/devices/row_merge.py):
stacking them would make a tensor as tall as the batch, a serving compile for each mix.
"""

from __future__ import annotations

import torch

from engine.config import ServingLimits
from engine.devices.row_merge import merge_rows, stack_rows
from engine.errors import InvalidRequestError
from engine.runner import DecodeInput, ModelRunner, PrefillInput


def recompute_position(model) -> int | None:
    return getattr(model, "recompute_cache_at", None)


def decode_logits(runner: ModelRunner, sequences, inputs: list[DecodeInput]) -> torch.Tensor:
    """Logits [len(inputs), vocab] of the next token of every sequence."""
    at = recompute_position(runner.model)
    redo = [i for i, inp in enumerate(inputs) if at is not None and inp.position == at]
    if not redo:
        return runner.decode(inputs)
    rest = [i for i in range(len(inputs)) if i not in redo]
    parts = []  # (the rows of a forward, the index in `inputs` of each)
    if rest:
        parts.append((runner.decode([inputs[i] for i in rest]), rest))
    whole = [
        PrefillInput(
            list(sequences[i].token_ids),
            sequences[i].slots(0, inputs[i].position + 1),
            adapter=inputs[i].adapter,
        )
        for i in redo
    ]
    parts.append((runner.prefill(whole).logits, redo))
    count = len(inputs)
    if not runner.adapter.warm_runs_forward:
        return stack_rows(parts, count)
    padded = [(getattr(rows, "bucket_output", rows), index) for rows, index in parts]
    return merge_rows(runner.adapter, padded, count, runner.plan.sampler_rows(count))


def recompute_length(model, max_total_tokens: int) -> int:
    """The longest prefill a recompute needs when sequences may hold `max_total_tokens` (0: none).
    A sequence feeds position `at` back only if it holds at least at + 2 tokens."""
    at = recompute_position(model)
    return at + 1 if at is not None and max_total_tokens >= at + 2 else 0


def check_recompute_fits(model, limits: ServingLimits) -> None:
    """The recompute is a prefill of `at + 1` tokens: the prefill limits (and buckets) must hold it
    whenever a sequence can reach that position."""
    needed = recompute_length(model, limits.max_total_tokens)
    at = needed - 1
    if needed and min(limits.max_input_tokens, limits.max_prefill_tokens) < needed:
        raise InvalidRequestError(
            f"max_total_tokens={limits.max_total_tokens} lets sequences pass the model's "
            f"original_max_position_embeddings={at}, where its cache is recomputed with the long "
            f"rope factors by a prefill of {at + 1} tokens: max_input_tokens must be at least "
            f"{at + 1} (or keep max_total_tokens at most {at + 1})"
        )
