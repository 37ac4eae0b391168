"""Image buckets: the shapes a vision-language model's tower runs at, planned with the rest.

A tower run is `count` inputs of one `size`: images at the tower's resolution (LLaVA), tiles
(LLaVA-NeXT: an image is its base tile and its grid's), or, for a model of dynamic resolution,
whatever unit its own key names (engine/vision/encoder.py, `image_shape_key`). A bucket is one
`(count, size)`; a run of more inputs than the largest bucket of its size is split, fewer are
padded with zero inputs, so every image runs at a warmed shape.

- the grids (every strategy but fitted): counts 1, 2, 4, ... up to the tower's largest batch, at
  every size the model names;
- fitted: counts fitted to the recorded image runs (`{"phase": "image", ...}` lines of a
  `--record-shapes` trace) by the same exact 1-D dynamic program as decode's batch values
  (engine/buckets/fitted.py), as many counts per size as the grid has, the largest kept, so
  that every run still fits.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(frozen=True, order=True)
class ImageBucket:
    count: int  # tower inputs of one run: images, tiles, or a dynamic model's unit
    size: int  # each input's size key: a square tile's side in pixels, or the model's own

    def __post_init__(self) -> None:
        if self.count < 1 or self.size < 1:
            raise ValueError(f"image bucket ({self.count}, {self.size}): both must be positive")


@dataclass(frozen=True)
class ImageLimits:
    """What a model's tower takes: at most `max_count` inputs a run, each of one of `sizes`."""

    max_count: int
    sizes: tuple[int, ...]


def grid_counts(max_count: int) -> list[int]:
    """Powers of two below max_count, and max_count."""
    counts, count = [], 1
    while count < max_count:
        counts.append(count)
        count *= 2
    return counts + [max_count]


def image_grid(limits: ImageLimits) -> tuple[ImageBucket, ...]:
    return tuple(
        ImageBucket(count, size) for size in limits.sizes for count in grid_counts(limits.max_count)
    )


def recorded_runs(shapes, limits: ImageLimits) -> dict[int, Counter]:
    """size -> {count: runs} of a trace's image records; counts beyond the largest run split."""
    by_size: dict[int, Counter] = {}
    for shape in shapes or ():
        if shape.phase != "image":
            continue
        size = min((s for s in limits.sizes if s >= shape.size), default=None)
        if size is None:
            continue  # bigger than any size the model takes: a refused image
        full, rest = divmod(shape.batch_size, limits.max_count)
        runs = by_size.setdefault(size, Counter())
        runs[limits.max_count] += full
        if rest:
            runs[rest] += 1
    return by_size


def fitted_images(limits: ImageLimits, shapes) -> tuple[ImageBucket, ...]:
    """Per size, the counts that pad the recorded runs least, as many as the grid has (the grid
    itself for a size with no recorded run)."""
    from engine.buckets.fitted import _layers_1d  # numpy only when fitting

    budget = len(grid_counts(limits.max_count))
    by_size, buckets = recorded_runs(shapes, limits), []
    for size in limits.sizes:
        runs = by_size.get(size)
        if not runs:
            buckets += [ImageBucket(c, size) for c in grid_counts(limits.max_count)]
            continue
        candidates = sorted(set(runs) | {limits.max_count})
        curve = _layers_1d(runs, candidates, budget)
        _, counts = min(curve, key=lambda option: option[0])  # the fewest padded inputs
        buckets += [ImageBucket(c, size) for c in counts]
    return tuple(sorted(set(buckets), key=lambda b: (b.size, b.count)))


def plan_images(
    strategy: str, limits: ImageLimits | None, shapes=None, planned=None
) -> tuple[ImageBucket, ...]:
    """The image buckets of a plan: `planned` (a bucket file's) when given, fitted ones for the
    fitted strategy on a trace with image records, else the grid."""
    if limits is None:
        return ()
    if planned:
        return tuple(planned)
    if strategy == "fitted" and recorded_runs(shapes, limits):
        return fitted_images(limits, shapes)
    return image_grid(limits)


def image_problems(buckets, limits: ImageLimits) -> list[str]:
    """What makes a plan's image buckets unusable for this tower."""
    problems = [
        f"image bucket [{b.count}, {b.size}] is beyond the tower's limits "
        f"(at most {limits.max_count} inputs a run, sizes {list(limits.sizes)})"
        for b in buckets
        if b.count > limits.max_count or b.size not in limits.sizes
    ]
    problems += [
        f"no image bucket of size {size}: images of that size could not run"
        for size in limits.sizes
        if not any(b.size == size for b in buckets)
    ]
    return problems


def split_run(buckets, count: int, size: int) -> list[tuple[int, ImageBucket]]:
    """The runs of `count` inputs of `size`: (inputs, bucket) each, the largest bucket of the
    smallest planned size that holds `size` until what is left fits a smaller one (the fewest
    padded inputs). [] when no bucket holds the size."""
    fitting = [b.size for b in buckets if b.size >= size]
    if not fitting:
        return []
    chosen = min(fitting)
    counts = sorted(b.count for b in buckets if b.size == chosen)
    runs, left = [], count
    while left > 0:
        bucket_count = next((c for c in counts if c >= left), counts[-1])
        runs.append((min(left, bucket_count), ImageBucket(bucket_count, chosen)))
        left -= bucket_count
    return runs


def image_cost(buckets, limits: ImageLimits, shapes) -> dict:
    """Real and padded tower inputs of a trace's image runs under `buckets`."""
    real = padded = 0
    for size, runs in recorded_runs(shapes, limits).items():
        for count, times in runs.items():
            real += count * times
            padded += sum(b.count for _, b in split_run(buckets, count, size)) * times
    return {"real": real, "padded": padded, "waste": 1.0 - real / padded if padded else 0.0}
