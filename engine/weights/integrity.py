"""Whether a model file is whole, read from its header alone and without torch (the router and
the launcher check files too): a GGUF file's header and tensor index (read_gguf_index, whose
layout also keys the conversion cache) and a safetensors file's header (check_safetensors). A
truncated or corrupt file is one CorruptFileError that names it."""

from __future__ import annotations

import json
import math
import mmap
import struct
from dataclasses import dataclass
from pathlib import Path

from engine.errors import CorruptFileError

# The GGUF header (version 2 and 3): magic, version, tensor count, metadata count, then the metadata
# (key, type, value) and one index entry per tensor (name, dims, type, offset into the data
# section).
GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
ALIGNMENT_KEY = "general.alignment"
SCALAR_FORMATS = {
    0: "B",
    1: "b",
    2: "H",
    3: "h",
    4: "I",
    5: "i",
    6: "f",
    7: "?",
    10: "Q",
    11: "q",
    12: "d",
}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class GgufIndex:
    """Where a GGUF file's parts lie, read from its header and tensor index without its data."""

    path: Path
    size: int  # bytes in the file
    data_offset: int  # the tensor data starts here; before it: the header and the tensor index
    data_end: int  # the last byte the tensor index places, plus one
    tensors: int


class _HeaderReader:
    """Reads the header of `data` (the mapped file) and names the file when it ends too soon."""

    def __init__(self, data, path: Path):
        self.data, self.path, self.pos = data, path, 0

    def corrupt(self, why: str) -> CorruptFileError:
        return CorruptFileError(
            f"cannot read GGUF file {self.path}: it is truncated or corrupt ({why})"
        )

    def take(self, size: int, what: str) -> bytes:
        if size < 0 or self.pos + size > len(self.data):
            raise self.corrupt(f"it ends at byte {len(self.data)} inside its header ({what})")
        chunk = self.data[self.pos : self.pos + size]
        self.pos += size
        return chunk

    def scalar(self, fmt: str, what: str):
        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        raw = self.take(self.scalar("Q", what), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.corrupt(f"{what} is not UTF-8 text") from None

    def value(self, kind: int, what: str):
        if kind in SCALAR_FORMATS:
            return self.scalar(SCALAR_FORMATS[kind], what)
        if kind == STRING:
            return self.string(what)
        if kind != ARRAY:
            raise self.corrupt(f"{what} has an unknown value type {kind}")
        item, count = self.scalar("I", what), self.scalar("Q", what)
        if item in SCALAR_FORMATS:  # a fixed-size array: skipped, not unpacked
            self.take(count * struct.calcsize(SCALAR_FORMATS[item]), what)
            return None
        for _ in range(count):
            self.value(item, what)
        return None


def read_gguf_index(path: Path) -> GgufIndex:
    """The layout of GGUF file `path`; a CorruptFileError naming it when the header does not
    parse or the index places tensor data past the end of the file (a truncated copy)."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    with open(path, "rb") as file:
        size = Path(path).stat().st_size
        mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ) if size else memoryview(b"")
        with mapped as data:
            header = _HeaderReader(data, Path(path))
            if header.take(4, "magic") != GGUF_MAGIC:
                raise header.corrupt("it does not start with the GGUF magic bytes")
            if (version := header.scalar("I", "version")) not in GGUF_VERSIONS:
                raise header.corrupt(f"unknown GGUF version {version}")
            tensors = header.scalar("Q", "tensor count")
            entries = header.scalar("Q", "metadata count")
            alignment = 32
            for _ in range(entries):
                key = header.string("a metadata key")
                value = header.value(header.scalar("I", key), key)
                if key == ALIGNMENT_KEY:
                    alignment = value
            data_end = 0
            for _ in range(tensors):
                name = header.string("a tensor name")
                dims = [header.scalar("Q", name) for _ in range(header.scalar("I", name))]
                kind, offset = header.scalar("I", name), header.scalar("Q", name)
                try:
                    block, block_bytes = GGML_QUANT_SIZES[GGMLQuantizationType(kind)]
                except (ValueError, KeyError):
                    raise header.corrupt(f"tensor {name!r} has an unknown type {kind}") from None
                count = math.prod(dims)
                data_end = max(data_end, offset + count // block * block_bytes)
    if not isinstance(alignment, int) or alignment <= 0:
        raise header.corrupt(f"{ALIGNMENT_KEY} is {alignment!r}")
    data_offset = -(-header.pos // alignment) * alignment
    if data_offset + data_end > size:
        raise header.corrupt(
            f"its tensor index places data up to byte {data_offset + data_end}, "
            f"but the file has {size} bytes"
        )
    return GgufIndex(Path(path), size, data_offset, data_offset + data_end, tensors)


SAFETENSORS_HEADER_LIMIT = 100_000_000  # the safetensors format's own bound on the JSON header


def check_safetensors(file: Path) -> None:
    """A CorruptFileError naming `file` when it is not a safetensors file or is shorter than its
    header says (a truncated copy); reads only the header."""
    size = file.stat().st_size
    with open(file, "rb") as reader:
        prefix = reader.read(8)
        length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
        if not 0 < length <= SAFETENSORS_HEADER_LIMIT:
            raise _corrupt(
                file, f"not a safetensors file (its {size} bytes do not start with a header length)"
            )
        if length > size - 8:
            raise _corrupt(
                file, f"truncated: its header alone is {8 + length} bytes, but the file has {size}"
            )
        try:
            header = json.loads(reader.read(length))
            ends = (int(t["data_offsets"][1]) for k, t in header.items() if k != "__metadata__")
            end = 8 + length + max(ends, default=0)
        except (ValueError, TypeError, KeyError, IndexError, AttributeError):
            raise _corrupt(
                file, "not a safetensors file (its header is not a safetensors JSON index)"
            ) from None
    if end > size:
        raise _corrupt(
            file,
            f"truncated: its header places tensor data up to byte {end}, but the "
            f"file has {size} bytes",
        )


def _corrupt(file: Path, why: str) -> CorruptFileError:
    return CorruptFileError(f"weight file {file} is corrupt or unreadable: {why}")
