"""Graph inputs are tensors only.

An HPU graph cache hashes Python scalars by value, so a scalar such as a sequence length among the
inputs compiles one new graph per value and eventually runs out of device memory. A CUDA graph
cannot see a new scalar at all: it replays the value it was captured with. Every input is a
tensor, None, or a tuple (NamedTuple included) or list of those.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch


class GraphInputError(TypeError):
    """An input that a graph would hash by value or silently freeze."""


def leaves(value, path: str = "inputs") -> Iterator[tuple[str, torch.Tensor | None]]:
    """(path, tensor or None) for every leaf, in a fixed order; raises on anything else."""
    if value is None or isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, (tuple, list)):
        names = getattr(value, "_fields", None) or [f"[{i}]" for i in range(len(value))]
        for name, item in zip(names, value):
            yield from leaves(
                item, f"{path}.{name}" if hasattr(value, "_fields") else f"{path}{name}"
            )
    else:
        raise GraphInputError(
            f"graph input {path} is a Python {type(value).__name__} ({value!r}): graph inputs "
            "must be tensors, or a graph is compiled per value"
        )


def check_tensor_inputs(args: tuple) -> None:
    for _ in leaves(args):
        pass


def copy_into(static: tuple, fresh: tuple) -> None:
    """Copy every tensor of `fresh` into the same-placed tensor of `static` (a graph's buffers)."""
    for (path, dst), (_, src) in zip(leaves(static), leaves(fresh), strict=True):
        if (dst is None) != (src is None):
            raise GraphInputError(
                f"graph input {path} was {'None' if dst is None else 'a tensor'} at capture"
            )
        if dst is not None:
            if dst.shape != src.shape:
                raise GraphInputError(
                    f"graph input {path} has shape {tuple(src.shape)}, captured {tuple(dst.shape)}"
                )
            dst.copy_(src, non_blocking=True)
