"""Which kernels compute attention: pure torch by default, a device's own when its adapter says so.

A device adapter (engine/devices/) may supply faster kernels with the same contracts as
`prompt_attention` and `flat_attention`; it activates them only around its own forwards, so the
model code never asks which device it runs on.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import NamedTuple

from engine.attention.flat import flat_attention
from engine.attention.prompt import prompt_attention


class AttentionBackend(NamedTuple):
    name: str
    prefill: Callable  # as prompt_attention(q, k, v, scale, lengths=None)
    decode: Callable  # as flat_attention(q, key_cache, value_cache, block_list, ..., scale, masked)
    # as context_attention(q, k, v, key_cache, value_cache, context_slots, context_lens, scale);
    # None: the pure-torch one
    context: Callable | None = None


TORCH = AttentionBackend("torch", prompt_attention, flat_attention)
_active: AttentionBackend = TORCH


def active_backend() -> AttentionBackend:
    return _active


@contextmanager
def use_backend(backend: AttentionBackend | None) -> Iterator[None]:
    """Route attention through `backend` (None: pure torch) until the block ends."""
    global _active
    previous, _active = _active, backend or TORCH
    try:
        yield
    finally:
        _active = previous
