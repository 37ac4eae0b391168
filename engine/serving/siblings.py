"""Siblings: requests of one Prefill that share a prompt (OpenAI `n`, TGI `best_of`).

A request whose `prefill_source` names another request of the same Prefill skips the prompt's
forward: the source's prompt is computed once, its K/V are copied slot by slot into the sibling's
own slots (engine/kv_cache.py, one fixed-length index per copy), and the sibling's first token is
sampled from the source's last-position logits with the sibling's own sampler (its own seed). From
then on siblings are ordinary sequences. A source missing from the Prefill, a source that is itself
a sibling, or a resumed request (its token list holds generated tokens) falls back to computing its
own prompt; a source with another prompt or adapter is the caller's mistake.
"""

from __future__ import annotations

import torch

from engine.devices.row_merge import mark_step
from engine.errors import InvalidRequestError
from engine.kv_cache import RESERVED_BLOCK
from engine.serving.sequence import Sequence


def sources(sequences: list[Sequence]) -> dict[int, int]:
    """Index of each sibling that copies its prompt -> index of the sequence it copies it from."""
    index = {s.id: i for i, s in enumerate(sequences)}
    shared = {}
    for i, seq in enumerate(sequences):
        source = seq.request.prefill_source
        j = index.get(source) if source is not None and source != seq.id else None
        if j is None or sequences[j].request.prefill_source not in (None, sequences[j].id):
            continue
        if seq.generated or sequences[j].generated:
            continue  # a resumed request prefills its own prompt and generated tokens
        if seq.request.prefill_logprobs and not sequences[j].request.prefill_logprobs:
            continue  # the source's forward would not score the prompt
        if (
            seq.token_ids != sequences[j].token_ids
            or seq.request.adapter_id != sequences[j].request.adapter_id
        ):
            raise InvalidRequestError(
                f"request {seq.id}: prefill_source {source} has another prompt or adapter"
            )
        shared[i] = j
    return shared


def copy_prompts(runner, sequences: list[Sequence], shared: dict[int, int], width: int) -> None:
    """Copy each source's prompt K/V into its siblings' slots, in pieces of one fixed length, the
    longest prefill bucket's (at most `width`, the longest prompt the server takes): on a graph
    device each piece is the same graph whatever the prompt, compiled before serving
    (warm_prompt_copy)."""
    piece = copy_width(runner)
    for i, j in shared.items():
        start, length = (
            sequences[i].computed,
            sequences[j].prompt_len,
        )  # a prefix-cache hit is in place already
        source, target = sequences[j].slots(start, length), sequences[i].slots(start, length)
        starts = range(0, len(source), piece)
        for at in starts:
            _copy_piece(runner, source[at : at + piece], target[at : at + piece], piece)
        runner.kv_cache.copied_prompts -= max(len(starts) - 1, 0)  # one prompt, in pieces


def copy_width(runner) -> int:
    return runner.plan.max_prefill_seq_len


def warm_prompt_copy(runner) -> None:
    """Compile the copy of one piece (the reserved slot onto itself) before serving."""
    _copy_piece(runner, [], [], copy_width(runner))
    runner.kv_cache.copied_prompts -= 1  # a warmup copy shares no prompt


def _copy_piece(runner, source: list[int], target: list[int], piece: int) -> None:
    pad = [RESERVED_BLOCK] * (piece - len(source))
    adapter = runner.adapter
    runner.kv_cache.copy_slots(
        adapter.to_device(torch.tensor(source + pad, dtype=torch.long)),
        adapter.to_device(torch.tensor(target + pad, dtype=torch.long)),
    )
    mark_step(adapter)


def logits_rows(computed: list[int], shared: dict[int, int], count: int) -> list[int]:
    """For each of `count` sequences, its row among the computed sequences' logits."""
    row = {index: r for r, index in enumerate(computed)}
    return [row[shared.get(i, i)] for i in range(count)]
