"""Step markers: the points in a forward where a lazily-executing device should cut its graph.

The model calls `mark_step()` after each decoder layer and the tensor-parallel collectives call it
before they communicate. With no marker installed (CPU, CUDA, XPU, HPU compile mode) it does
nothing. An adapter installs its marker only for the duration of its own forwards, so two adapters
in one process (as in the tests) never see each other's marker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

_marker: Callable[[], None] | None = None


def mark_step() -> None:
    """Cut the lazy graph here (HPU lazy mode); a no-op elsewhere."""
    if _marker is not None:
        _marker()


@contextmanager
def step_markers(marker: Callable[[], None] | None) -> Iterator[None]:
    global _marker
    previous, _marker = _marker, marker
    try:
        yield
    finally:
        _marker = previous
