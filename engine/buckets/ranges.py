"""The values one bucket dimension (batch size, sequence length, KV blocks) is bucketed on.

Published strategies (linear, exponential, padding-aware) as pure functions of (min, step, max):
standard library only, so planning never imports torch.
"""

from __future__ import annotations

import math
from collections.abc import Callable


def _require_positive(name: str, value: object) -> None:
    # bool is an int subclass; True as a batch size is always a bug upstream.
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _check_range_args(min_value: int, step: int, max_value: int) -> None:
    _require_positive("min_value", min_value)
    _require_positive("step", step)
    _require_positive("max_value", max_value)
    if min_value > max_value:
        raise ValueError(f"min_value ({min_value}) must be <= max_value ({max_value})")


# ---------------------------------------------------------------------------------------
# Range strategies: the values one dimension (batch, length, blocks) is bucketed on.
# ---------------------------------------------------------------------------------------


def linear_range(min_value: int, step: int, max_value: int) -> list[int]:
    """vLLM-Gaudi's "warmup_range": double from min_value while below step, then add step.

    Small values double because padding 3 rows to 32 would waste most of the batch;
    large values go up by step so padding never exceeds one step. max_value is always
    the last value so that the longest allowed input has a bucket.
    e.g. linear_range(1, 32, 128) == [1, 2, 4, 8, 16, 32, 64, 96, 128]
    """
    _check_range_args(min_value, step, max_value)
    values = [min_value]
    # Ramp values stay strictly below step (and below max_value, appended last).
    while values[-1] * 2 < min(step, max_value):
        values.append(values[-1] * 2)
    # Next multiple of step strictly above the last value: aligns the linear part on
    # step even when min_value is not a power-of-two fraction of it.
    value = (values[-1] // step + 1) * step
    while value < max_value:
        values.append(value)
        value += step
    if values[-1] != max_value:
        values.append(max_value)
    return values


def _covers(candidate: int, min_value: int, max_value: int, i: int, n_minus_1: int) -> bool:
    """Exactly: candidate >= min * (max/min) ** (i / n_minus_1).

    Raised to the n_minus_1-th power this is pure integer arithmetic; floats get it
    wrong (32 ** (4/5) == 16.000000000000004 would round up to 17, not 16).
    """
    return candidate**n_minus_1 * min_value**i >= max_value**i * min_value**n_minus_1


def _exponential_point(min_value: int, step: int, max_value: int, i: int, n_minus_1: int) -> int:
    """The i-th exponential point rounded up to a multiple of step, clamped to max_value."""
    estimate = min_value * (max_value / min_value) ** (i / n_minus_1)
    k = max(1, math.ceil(estimate / step))
    # The float estimate is off by at most one step; the exact test settles it.
    while k > 1 and _covers((k - 1) * step, min_value, max_value, i, n_minus_1):
        k -= 1
    while not _covers(k * step, min_value, max_value, i, n_minus_1):
        k += 1
    return min(k * step, max_value)


def exponential_range(
    min_value: int, step: int, max_value: int, count: int | None = None
) -> list[int]:
    """vLLM-Gaudi's exponential strategy: count points spaced geometrically from min to max.

    Point i is min * (max/min) ** (i/(count-1)), rounded up to a multiple of step (shapes
    aligned on step compile to better kernels) and clamped to max_value. Duplicates are
    dropped, so fewer than count values may come back. Geometric spacing bounds the
    padding ratio instead of the padding amount, which suits long sequence ranges.
    Default count: ceil(log2(max_value)) + 1, at least 2.
    """
    _check_range_args(min_value, step, max_value)
    if count is not None:
        _require_positive("count", count)
    if min_value == max_value:
        return [max_value]
    # (max-1).bit_length() == ceil(log2(max)) for max >= 1, without float log.
    n = count if count is not None else max(2, (max_value - 1).bit_length() + 1)
    if n < 2:
        raise ValueError(
            f"count must be >= 2 when min_value ({min_value}) < max_value ({max_value}), got {n}"
        )
    values = {min_value, max_value}
    for i in range(1, n - 1):
        values.add(_exponential_point(min_value, step, max_value, i, n - 1))
    return sorted(values)


DEFAULT_PADDING_BOUND = 0.25


def padding_range(
    min_value: int, step: int, max_value: int, bound: float = DEFAULT_PADDING_BOUND
) -> list[int]:
    """Padding-aware: the fewest of linear_range's values such that a value padded up to its bucket
    loses at most `bound` of the bucket, wherever that grid allows it.

    Built from the top down: below a kept value v, the next kept value is the smallest grid value c
    from which c + 1 pads to v within the bound ((v - c - 1) / v <= bound); when the grid has no
    such value below v, the one just below v is kept (a coarse grid cannot do better there).
    """
    _check_range_args(min_value, step, max_value)
    if not 0 < bound < 1:
        raise ValueError(f"padding bound must be in (0, 1), got {bound!r}")
    grid = linear_range(min_value, step, max_value)
    kept = [max_value]
    while kept[-1] > min_value:
        below = [c for c in grid if c < kept[-1]]
        within = [c for c in below if kept[-1] - c - 1 <= bound * kept[-1]]
        kept.append(min(within) if within else max(below))
    return kept[::-1]


STRATEGIES: dict[str, Callable[[int, int, int], list[int]]] = {
    "linear": linear_range,
    "exponential": exponential_range,
    "padding": padding_range,
}
