"""Dynamic resolution (Qwen2.5-VL) in planned image buckets, and its multimodal rope positions.

The model's processor resizes an image to any grid of merged patches (`smart_resize`: sides
multiples of patch_size * merge_size, min_pixels <= pixels <= max_pixels) and the tower runs at
that grid. A graph device cannot meet every grid, so the grids are bucketed like sequence lengths:
each side is one of a ladder of sizes (1, 2, 3, 4, 6, 8, 12, ...: powers of two and 1.5 times
them), every pair the processor allows is planned (and warmed), and an image is resized to the
planned grid nearest (in log scale) to the one the processor would pick; an image whose own grid
is planned is left to the processor as it is. The router counts the same grid's tokens.

In the plan each grid is an image bucket of one image whose size key is `grid_key(grid)`: every
strategy, fitted included, plans every grid, since the router counts an image's tokens at the
grid nearest to its own and a grid left out could not run; a `--record-shapes` trace records
each tower run as `{"phase": "image", "batch_size": 1, "size": grid_key(grid)}`.

M-RoPE: image tokens carry 3-row positions (temporal, height, width) from where the image starts;
text positions are equal on all three rows and continue from the image's largest position + 1,
as transformers' Qwen2_5_VLModel.get_rope_index computes them. After the prompt every row's
position is its sequence position plus the prompt's delta (max + 1 - prompt length)."""

from __future__ import annotations

import math
from functools import lru_cache

import torch

MAX_RATIO = 200  # smart_resize refuses a longer side past 200 times the shorter one
GRID_KEY = 10_000  # a grid's size key in the plan's image buckets: rows * GRID_KEY + columns


def grid_key(grid: tuple[int, int]) -> int:
    """The image buckets' size key of a grid (engine/buckets/images.py): 40006 is 4 x 6."""
    rows, columns = grid
    if not (0 < rows < GRID_KEY and 0 < columns < GRID_KEY):
        raise ValueError(f"grid {rows}x{columns}: each side must be 1 to {GRID_KEY - 1}")
    return rows * GRID_KEY + columns


def key_grid(key: int) -> tuple[int, int]:
    """The grid of an image bucket's size key."""
    return divmod(key, GRID_KEY)


def ladder(limit: int) -> list[int]:
    """Side lengths (in merged patches) up to `limit`: 1, 2, 3, 4, 6, 8, 12, 16, 24, ..."""
    sides, power = [1], 2
    while power <= limit:
        sides += [s for s in (power, power * 3 // 2) if s <= limit]
        power *= 2
    return sides


@lru_cache(maxsize=16)
def plan_grids(factor: int, min_pixels: int, max_pixels: int) -> tuple[tuple[int, int], ...]:
    """Every (rows, columns) of merged patches on the ladder the processor accepts as it is."""
    area = factor * factor
    sides = ladder(max_pixels // area)
    return tuple(
        (rows, columns)
        for rows in sides
        for columns in sides
        if min_pixels <= rows * columns * area <= max_pixels
        and max(rows, columns) / min(rows, columns) <= MAX_RATIO
    )


def natural_grid(spec, width: int, height: int) -> tuple[int, int]:
    """The (rows, columns) of merged patches the processor resizes the image to by itself."""
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    resized_height, resized_width = smart_resize(
        height, width, spec.factor, spec.min_pixels, spec.max_pixels
    )
    return resized_height // spec.factor, resized_width // spec.factor


def nearest_grid(spec, width: int, height: int) -> tuple[int, int]:
    """The planned grid an image is served at: its own grid where planned, else the nearest."""
    rows, columns = natural_grid(spec, width, height)
    grids = plan_grids(spec.factor, spec.min_pixels, spec.max_pixels)
    if (rows, columns) in grids:
        return rows, columns

    def distance(grid: tuple[int, int]) -> tuple[float, int]:
        skew = math.log(grid[0] / rows) ** 2 + math.log(grid[1] / columns) ** 2
        return round(skew, 12), -grid[0] * grid[1]  # ties: the larger grid

    return min(grids, key=distance)


def fit_to_grid(image, spec, resample: int):
    """The PIL image resized to its planned grid's pixels where its own grid is not planned (the
    processor then keeps its size); as it is otherwise."""
    width, height = image.size
    rows, columns = nearest_grid(spec, width, height)
    if (rows, columns) == natural_grid(spec, width, height):
        return image
    return image.resize((columns * spec.factor, rows * spec.factor), resample=resample)


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
