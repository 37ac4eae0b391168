"""Batch-shape traces: what a shard served, recorded as JSON lines so the planner can replay it.

One line per forward request the runner received, before any bucket padding or splitting:
  {"phase": "prefill", "batch_size": b, "seq_len": s}      s: the longest prompt of the batch
  {"phase": "prefill", "batch_size": b, "seq_len": s, "context_blocks": c}   s new tokens after c
  cached blocks {"phase": "decode", "batch_size": b, "num_blocks": k}    k: KV blocks of the whole
  batch {"phase": "verify", "batch_size": b, "width": w, "context_blocks": c}   speculative
  decoding:
      w tokens a row (its latest and its proposals) after at most c cached blocks
      (engine/speculative/)
  {"phase": "image", "batch_size": n, "size": s}    a vision tower's run: n inputs (images, or
      tiles) of size s (a tile's side in pixels, or a dynamic-resolution model's own size key),
      all the inputs of one encode, before they are split or padded (engine/buckets/images.py)
Standard library only: the `buckets` command reads traces without importing torch.
"""

from __future__ import annotations

import json
import threading
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

SIZE_KEY = {"prefill": "seq_len", "decode": "num_blocks", "verify": "width", "image": "size"}


@dataclass(frozen=True)
class Shape:
    phase: str  # "prefill", "decode", "verify" or "image"
    batch_size: int  # real rows of the batch
    size: (
        int  # prefill: longest prompt in tokens; decode: KV blocks of the whole batch; image: size
    )
    context_blocks: int = 0  # prefill: most cached context blocks of a row (prefix cache, chunks)

    def as_json(self) -> dict:
        record = {
            "phase": self.phase,
            "batch_size": self.batch_size,
            SIZE_KEY[self.phase]: self.size,
        }
        if self.context_blocks:
            record["context_blocks"] = self.context_blocks
        return record


class ShapeFileError(ValueError):
    """A malformed line of a shapes file; the message starts with FILE:LINE."""


def parse_shape(text: str) -> Shape:
    """One JSONL record; ValueError saying what is wrong (the caller adds the line number)."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as err:
        raise ValueError(f"not JSON ({err.msg})") from None
    if not isinstance(record, dict) or record.get("phase") not in SIZE_KEY:
        raise ValueError('expected {"phase": "prefill"|"decode"|"verify"|"image", ...}')
    phase = record["phase"]
    key = SIZE_KEY[phase]
    for name in ("batch_size", key):
        value = record.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"{phase} record needs a positive integer {name!r}, got {value!r}")
    context = record.get("context_blocks", 0)
    if phase in ("decode", "image") and "context_blocks" in record:
        raise ValueError("context_blocks belongs to verify and prefill records only")
    if not isinstance(context, int) or isinstance(context, bool) or context < 0:
        raise ValueError(
            f"prefill record needs a non-negative integer 'context_blocks', got {context!r}"
        )
    return Shape(phase, record["batch_size"], record[key], context)


def load_shapes(path: str | Path) -> list[Shape]:
    """Every shape of a JSONL trace (blank lines skipped); a bad line fails with FILE:LINE: why."""
    shapes = []
    with open(path, encoding="utf-8") as lines:
        for number, line in enumerate(lines, 1):
            if not line.strip():
                continue
            try:
                shapes.append(parse_shape(line))
            except ValueError as err:
                raise ShapeFileError(f"{path}:{number}: {err}") from None
    return shapes


def count_shapes(shapes, phase: str) -> Counter:
    """(batch_size, size) -> occurrences, for one phase (prefills without context: those with
    context are planned by engine.buckets.plan.fitted_context_plan)."""
    return Counter(
        (s.batch_size, s.size) for s in shapes if s.phase == phase and not s.context_blocks
    )


class ShapeRecorder:
    """Appends the shapes a shard serves to a JSONL file, one flushed line per forward request,
    so a trace survives a crash and can be read while the shard is running."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._file = open(self.path, "a", encoding="utf-8", buffering=1)  # line-buffered
        self._lock = threading.Lock()  # progressive warmup may serve from another thread

    def record(self, shape: Shape) -> None:
        with self._lock:
            self._file.write(json.dumps(shape.as_json()) + "\n")

    def prefill(self, batch_size: int, seq_len: int, context_blocks: int = 0) -> None:
        self.record(Shape("prefill", batch_size, seq_len, context_blocks))

    def decode(self, batch_size: int, num_blocks: int) -> None:
        self.record(Shape("decode", batch_size, num_blocks))

    def verify(self, batch_size: int, width: int, context_blocks: int) -> None:
        self.record(Shape("verify", batch_size, width, context_blocks))

    def image(self, count: int, size: int) -> None:
        self.record(Shape("image", count, size))

    def close(self) -> None:
        self._file.close()
