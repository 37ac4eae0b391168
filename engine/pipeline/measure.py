"""What the stages' spans (PipelineStage.spans) say: how busy each stage was over a window, how
long two stages worked at once, and which of their spans overlap on different steps (stage 0
working on one batch while the last stage works on another: pipelining)."""

from __future__ import annotations

from collections.abc import Iterable

from engine.pipeline.stage import Span


def _merged(spans: Iterable[Span], start: int, end: int) -> list[tuple[int, int]]:
    """The spans clipped to [start, end), overlapping ones merged, in time order."""
    merged: list[list[int]] = []
    for span in sorted(spans, key=lambda s: s.start):
        a, b = max(span.start, start), min(span.end, end)
        if a >= b:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def busy_ns(spans: Iterable[Span], start: int, end: int) -> int:
    return sum(b - a for a, b in _merged(spans, start, end))


def utilization(spans: Iterable[Span], start: int, end: int) -> float:
    """The stage's busy time over the window [start, end)."""
    return busy_ns(spans, start, end) / (end - start) if end > start else 0.0


def together_ns(first: Iterable[Span], second: Iterable[Span], start: int, end: int) -> int:
    """How long both stages worked at once within the window."""
    a_spans, b_spans = _merged(first, start, end), _merged(second, start, end)
    total, i, j = 0, 0, 0
    while i < len(a_spans) and j < len(b_spans):
        (a0, a1), (b0, b1) = a_spans[i], b_spans[j]
        total += max(0, min(a1, b1) - max(a0, b0))
        if a1 < b1:
            i += 1
        else:
            j += 1
    return total


def cross_step_overlaps(first: Iterable[Span], last: Iterable[Span]) -> list[tuple[int, int]]:
    """(step of `first`'s span, step of `last`'s span) for every pair of spans of different
    steps that intersect in time: one stage on one batch while the other is on another."""
    return [
        (a.step, b.step)
        for a in first
        for b in last
        if a.step != b.step and max(a.start, b.start) < min(a.end, b.end)
    ]
