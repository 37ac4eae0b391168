"""The rows of several bucket outputs as one tensor whose shape the plan fixes.

A batch larger than every bucket runs in several buckets, and a prefill whose rows continue cached
context runs apart from the rest; each forward returns its bucket's padded rows. Stacking the real
rows (`torch.stack`) makes a tensor as tall as the batch, so on a graph device every batch size is
a new graph, and the sampler that reads it another. Here every bucket output is copied into one
zero buffer of `rows + 1` rows (`rows`: the sampler's, a decode batch size of the plan; the last
row takes the buckets' padding rows), one `index_copy_` graph per bucket output, each cut by a
step; the merged rows are a view of the buffer, the sampler's rows another. Warmup runs every
(buffer, bucket output) pair (`warm_merges`), and the sampler's row gather (`gather_rows`) for
every (source, rows) pair, so none of them compiles while serving.
"""

from __future__ import annotations

import torch


def mark_step(adapter) -> None:
    """Cut the lazy graph (HPU, the simulator); nothing elsewhere."""
    marker = getattr(adapter, "mark_step", None)
    if marker is not None:
        marker()


def merge_rows(adapter, parts: list, count: int, rows: int) -> torch.Tensor:
    """[count, vocab]: row i is the row of `parts` [(bucket output, [destination of each of its
    real rows])] that goes to i. A view of a buffer whose first `rows` rows are at hand as
    `bucket_output` (engine/sampling/static.py reads them)."""
    first = parts[0][0]
    buffer = adapter.zeros((rows + 1, first.shape[1]), first.dtype)
    mark_step(adapter)  # the buffer's fill is a graph of its own, keyed by its shape alone
    for out, destinations in parts:
        padding = [rows] * (out.shape[0] - len(destinations))
        index = adapter.to_device(torch.tensor(destinations + padding, dtype=torch.long))
        buffer.index_copy_(0, index, out)
        mark_step(adapter)
    merged = buffer[:count]
    merged.bucket_output = buffer[:rows]
    return merged


def stack_rows(parts: list, count: int) -> torch.Tensor:
    """merge_rows' result where nothing compiles (CPU eager): the real rows stacked."""
    stacked = [None] * count
    for out, destinations in parts:
        for row, index in enumerate(destinations):
            stacked[index] = out[row]
    return torch.stack(stacked)


def gather_rows(adapter, source: torch.Tensor, row_index: list[int], rows: int) -> torch.Tensor:
    """[rows, vocab]: row i is source[row_index[i]], then copies of row 0 (padding); a graph of
    its own, so that the sampler's graph starts from the same [rows, vocab] input every time."""
    index = torch.tensor(row_index + [0] * (rows - len(row_index)), dtype=torch.long)
    gathered = source.index_select(0, adapter.to_device(index))
    mark_step(adapter)
    return gathered


def warm_merges(adapter, sampler_sizes, output_sizes, vocab: int, dtype=torch.float32) -> None:
    """Compile every merge and gather serving can meet: each sampler row count against each
    bucket output's row count (prefill and decode batch sizes)."""
    sources = sorted(set(output_sizes) | set(sampler_sizes))
    for rows in sorted(set(sampler_sizes)):
        parts = [
            (adapter.to_device(torch.zeros(size, vocab, dtype=dtype)), [0]) for size in sources
        ]
        merge_rows(adapter, parts, 1, rows)
        for source, _ in parts:  # the sources' row counts include the buffers' (rows)
            gather_rows(adapter, source, [0], rows)
