"""GGUF tensors read as they are stored: Q4_0 and Q4_1 blocks become int4 codes with a scale and a
zero per 32 inputs (engine.layers.quant.Int4Weight's form) without passing through float; other
types are dequantized by the `gguf` package (then quantized to the serving mode by engine.weights.quantize).

Block layouts (ggml's, 32 weights a block, little-endian): Q4_0 = d:f16, 16 bytes of nibbles,
w = (q - 8) d; Q4_1 = d:f16, m:f16, 16 bytes, w = q d + m. Byte j holds weight j in its low nibble
and weight j + 16 in its high one. llama.cpp's converter permutes the rows of Llama's q and k
projections (rotary halves interleaved); rows are whole blocks, so they are permuted back as codes.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from engine.errors import ModelLoadError

BLOCK = 32
LLAMA_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj", "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
}
LLAMA_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


@dataclass
class GgufInt4:
    """w[n, k] = (codes[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]"""
    codes: torch.Tensor  # [N, K] uint8, 0..15
    scale: torch.Tensor  # [N, K // 32] float32
    zero: torch.Tensor

    def rows(self, index) -> "GgufInt4":
        return GgufInt4(self.codes[index], self.scale[index], self.zero[index])

    def columns(self, start: int, stop: int) -> "GgufInt4":
        if start % BLOCK or stop % BLOCK:
            raise ModelLoadError(f"an int4 shard boundary ({start}:{stop}) cuts a block of {BLOCK} weights")
        groups = slice(start // BLOCK, stop // BLOCK)
        return GgufInt4(self.codes[:, start:stop], self.scale[:, groups], self.zero[:, groups])

    def dequantize(self) -> torch.Tensor:
        expand = lambda t: t.repeat_interleave(BLOCK, dim=1)  # noqa: E731
        return (self.codes.float() - 8) * expand(self.scale) + expand(self.zero)

    @staticmethod
    def cat(pieces: list["GgufInt4"]) -> "GgufInt4":
        return GgufInt4(*(torch.cat([getattr(p, f) for p in pieces]) for f in ("codes", "scale", "zero")))


def decode_q4(raw: np.ndarray, rows: int, cols: int, with_min: bool) -> GgufInt4:
    """Q4_1 (with_min) or Q4_0 blocks, `raw` [rows, bytes] uint8, as int4 codes, scales and zeros."""
    head = 4 if with_min else 2
    # a copy: the reader maps the file read-only
    blocks = torch.from_numpy(np.array(raw, dtype=np.uint8)).reshape(rows, cols // BLOCK, head + 16)
    d = blocks[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    nibbles = blocks[..., head:]
    codes = torch.cat([nibbles & 0x0F, nibbles >> 4], dim=-1).reshape(rows, cols)
    if with_min:  # q d + m = (q - 8) d + (m + 8 d)
        m = blocks[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
        return GgufInt4(codes, d, m + 8 * d)
    return GgufInt4(codes, d, torch.zeros_like(d))


def hf_name(gguf_name: str) -> str | None:
    """Our checkpoint name (without "model.") of a Llama GGUF tensor; None for one we do not use."""
    stem, _, kind = gguf_name.rpartition(".")
    if stem in LLAMA_TOP_NAMES:
        return f"{LLAMA_TOP_NAMES[stem]}.{kind}"
    match = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if match and match[2] in LLAMA_LAYER_NAMES:
        return f"layers.{match[1]}.{LLAMA_LAYER_NAMES[match[2]]}.{kind}"
    return None


def unpermute_rows(rows: int, heads: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's q/k permutation (as transformers' GGUF loader does)."""
    return torch.arange(rows).reshape(heads, rows // heads // 2, 2).transpose(1, 2).reshape(rows)


def read_weights(path: Path, num_heads: int, num_kv_heads: int) -> dict[str, GgufInt4 | torch.Tensor]:
    """Every tensor of a Llama GGUF file by our checkpoint name: GgufInt4 for Q4_0/Q4_1, float32 else."""
    from gguf import GGMLQuantizationType as Q, GGUFReader
    from gguf.quants import dequantize

    read_index(path)  # a truncated or corrupt file gets its one clear error, not the reader's
    try:
        reader = GGUFReader(path)
    except Exception as err:  # the reader raises many types for a bad file
        raise ModelLoadError(f"cannot read GGUF file {path}: {err}") from None
    weights = {}
    for tensor in reader.tensors:
        name = hf_name(tensor.name)
        if name is None:
            continue
        shape = [int(n) for n in reversed(tensor.shape)]  # ggml lists the fastest dimension first
        if tensor.tensor_type in (Q.Q4_0, Q.Q4_1) and len(shape) == 2:
            value = decode_q4(tensor.data, *shape, with_min=tensor.tensor_type == Q.Q4_1)
        else:
            value = torch.from_numpy(np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32))
            value = value.reshape(shape)
        if ".q_proj." in name or ".k_proj." in name:
            heads = num_heads if ".q_proj." in name else num_kv_heads
            order = unpermute_rows(shape[0], heads)
            value = value.rows(order) if isinstance(value, GgufInt4) else value[order]
        weights[name] = value
    return weights


# The GGUF header (version 2 and 3): magic, version, tensor count, metadata count, then the metadata
# (key, type, value) and one index entry per tensor (name, dims, type, offset into the data
# section).
GGUF_MAGIC = b"GGUF"
GGUF_VERSIONS = (2, 3)
ALIGNMENT_KEY = "general.alignment"
SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q",
                  12: "d"}
STRING, ARRAY = 8, 9


@dataclass(frozen=True)
class GgufIndex:
    """Where a GGUF file's parts lie, read from its header and tensor index without its data."""
    path: Path
    size: int         # bytes in the file
    data_offset: int  # the tensor data starts here; before it: the header and the tensor index
    data_end: int     # the last byte the tensor index places, plus one
    tensors: int


class _HeaderReader:
    """Reads the header of `data` (the mapped file) and names the file when it ends too soon."""

    def __init__(self, data, path: Path):
        self.data, self.path, self.pos = data, path, 0

    def corrupt(self, why: str) -> ModelLoadError:
        from engine.errors import CorruptFileError

        return CorruptFileError(f"cannot read GGUF file {self.path}: it is truncated or corrupt "
                                f"({why})")

    def take(self, size: int, what: str) -> bytes:
        if size < 0 or self.pos + size > len(self.data):
            raise self.corrupt(f"it ends at byte {len(self.data)} inside its header ({what})")
        chunk = self.data[self.pos:self.pos + size]
        self.pos += size
        return chunk

    def scalar(self, fmt: str, what: str):
        import struct

        return struct.unpack("<" + fmt, self.take(struct.calcsize(fmt), what))[0]

    def string(self, what: str) -> str:
        raw = self.take(self.scalar("Q", what), what)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise self.corrupt(f"{what} is not UTF-8 text") from None

    def value(self, kind: int, what: str):
        import struct

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


def read_index(path: Path) -> GgufIndex:
    """The layout of GGUF file `path`; a CorruptFileError naming it when the header does not
    parse or the index places tensor data past the end of the file (a truncated copy)."""
    import mmap

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
                count = int(np.prod(dims, dtype=np.float64))
                data_end = max(data_end, offset + count // block * block_bytes)
    if not isinstance(alignment, int) or alignment <= 0:
        raise header.corrupt(f"{ALIGNMENT_KEY} is {alignment!r}")
    data_offset = -(-header.pos // alignment) * alignment
    if data_offset + data_end > size:
        raise header.corrupt(f"its tensor index places data up to byte {data_offset + data_end}, "
                             f"but the file has {size} bytes")
    return GgufIndex(Path(path), size, data_offset, data_offset + data_end, tensors)
