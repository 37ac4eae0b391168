"""Dynamic resolution (Qwen2.5-VL) in planned image buckets, and its multimodal rope positions.

The model's processor resizes an image to a grid of merged patches of its own choosing
(`smart_resize`: sides multiples of patch_size * merge_size, min_pixels <= pixels <= max_pixels)
and the tower runs at that grid, as transformers runs it: every image is served at the grid the
processor gives it, so its tokens are transformers' for any size and aspect ratio. A graph device
cannot meet every grid, so the tower's runs are bucketed by their tokens (merged patches) like
sequence lengths: one image a run, padded to the smallest planned count that holds it, on a
ladder (1, 2, 3, 4, 6, 8, 12, ...: powers of two and 1.5 times them) from the fewest tokens the
processor allows to the most (engine/models/qwen2_5_vl.py keeps the padding apart from the image:
it attends only to itself). The router counts the same grid's tokens.

In the plan each bucket is an image bucket of one image whose size key is its token count: every
strategy, fitted included, plans every count (the router admits any image the processor takes);
a `--record-shapes` trace records each tower run as `{"phase": "image", "batch_size": 1, "size":
tokens}` (the image's own count; fitting maps it to the bucket that holds it).

M-RoPE: image tokens carry 3-row positions (temporal, height, width) from where the image starts;
text positions are equal on all three rows and continue from the image's largest position + 1,
as transformers' Qwen2_5_VLModel.get_rope_index computes them. After the prompt every row's
position is its sequence position plus the prompt's delta (max + 1 - prompt length)."""

from __future__ import annotations

import math
from functools import lru_cache

import torch


def ladder(limit: int) -> list[int]:
    """Side lengths (in merged patches) up to `limit`: 1, 2, 3, 4, 6, 8, 12, 16, 24, ..."""
    sides, power = [1], 2
    while power <= limit:
        sides += [s for s in (power, power * 3 // 2) if s <= limit]
        power *= 2
    return sides


@lru_cache(maxsize=16)
def token_buckets(factor: int, min_pixels: int, max_pixels: int) -> tuple[int, ...]:
    """The tower's planned token counts: the ladder from the fewest tokens an image may take to
    the most, and the most itself, so that every grid the processor picks has a bucket."""
    area = factor * factor
    fewest, most = max(1, math.ceil(min_pixels / area)), max_pixels // area
    return tuple(sorted({t for t in ladder(most) if t >= fewest} | {most}))


def natural_grid(spec, width: int, height: int) -> tuple[int, int]:
    """The (rows, columns) of merged patches the processor resizes the image to by itself."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    resized_height, resized_width = smart_resize(
        height, width, spec.factor, spec.min_pixels, spec.max_pixels
    )
    return resized_height // spec.factor, resized_width // spec.factor


def rope_index(
    ids: list[int], image_token_id: int, grids: list[tuple[int, int]]
) -> tuple[torch.Tensor, int]:
    """[3, len(ids)] M-RoPE positions of a prompt whose images (runs of the image token, in order)
    have these grids of merged patches, and the delta of the positions after it."""
    parts, current, start = [], 0, 0
    images = iter(grids)
    while start < len(ids):
        if ids[start] == image_token_id:
            rows, columns = next(images)
            height = torch.arange(rows).repeat_interleave(columns)
            width = torch.arange(columns).repeat(rows)
            parts.append(torch.stack([torch.zeros_like(height), height, width]) + current)
            current += max(rows, columns)
            start += rows * columns
            continue
        end = start
        while end < len(ids) and ids[end] != image_token_id:
            end += 1
        parts.append(torch.arange(current, current + end - start).expand(3, -1))
        current += end - start
        start = end
    table = torch.cat(parts, dim=1)
    return table, int(table.max()) + 1 - len(ids)


def chunk_positions(table: torch.Tensor, delta: int, start: int, end: int) -> torch.Tensor:
    """[3, end - start] positions of tokens [start, end) of a sequence whose prompt has `table`:
    the prompt's own, then (generated tokens a resumed request recomputes) position + delta."""
    prompt = table.shape[1]
    head = table[:, start : min(end, prompt)]
    if end <= prompt:
        return head
    tail = torch.arange(max(start, prompt), end).expand(3, -1) + delta
    return torch.cat([head, tail], dim=1)
