"""GGUF tensors read as they are stored: Q4_0 and Q4_1 blocks become int4 codes with a scale and a
zero per 32 inputs (engine.layers.quant.Int4Weight's form) without passing through float; other
types are dequantized by the `gguf` package (then quantized to the serving mode by
engine.weights.quantize).

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
from engine.weights.integrity import read_gguf_index

BLOCK = 32
LLAMA_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
LLAMA_TOP_NAMES = {"token_embd": "embed_tokens", "output_norm": "norm", "output": "lm_head"}


@dataclass
class GgufInt4:
    """w[n, k] = (codes[n, k] - 8) * scale[n, k // 32] + zero[n, k // 32]"""

    codes: torch.Tensor  # [N, K] uint8, 0..15
    scale: torch.Tensor  # [N, K // 32] float32
    zero: torch.Tensor

    def rows(self, index) -> GgufInt4:
        return GgufInt4(self.codes[index], self.scale[index], self.zero[index])

    def columns(self, start: int, stop: int) -> GgufInt4:
        if start % BLOCK or stop % BLOCK:
            raise ModelLoadError(
                f"an int4 shard boundary ({start}:{stop}) cuts a block of {BLOCK} weights"
            )
        groups = slice(start // BLOCK, stop // BLOCK)
        return GgufInt4(self.codes[:, start:stop], self.scale[:, groups], self.zero[:, groups])

    def dequantize(self) -> torch.Tensor:
        expand = lambda t: t.repeat_interleave(BLOCK, dim=1)  # noqa: E731
        return (self.codes.float() - 8) * expand(self.scale) + expand(self.zero)

    @staticmethod
    def cat(pieces: list[GgufInt4]) -> GgufInt4:
        return GgufInt4(
            *(torch.cat([getattr(p, f) for p in pieces]) for f in ("codes", "scale", "zero"))
        )


def decode_q4(raw: np.ndarray, rows: int, cols: int, with_min: bool) -> GgufInt4:
    """Q4_1 (with_min) or Q4_0 blocks, `raw` [rows, bytes] uint8, as int4 codes, scales and
    zeros."""
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


def read_weights(
    path: Path, num_heads: int, num_kv_heads: int
) -> dict[str, GgufInt4 | torch.Tensor]:
    """Every tensor of a Llama GGUF file by our checkpoint name: GgufInt4 for Q4_0/Q4_1, float32
    else."""
    from gguf import GGMLQuantizationType as Q
    from gguf import GGUFReader
    from gguf.quants import dequantize

    read_gguf_index(path)  # a truncated or corrupt file gets its one clear error, not the reader's
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
            value = torch.from_numpy(
                np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            )
            value = value.reshape(shape)
        if ".q_proj." in name or ".k_proj." in name:
            heads = num_heads if ".q_proj." in name else num_kv_heads
            order = unpermute_rows(shape[0], heads)
            value = value.rows(order) if isinstance(value, GgufInt4) else value[order]
        weights[name] = value
    return weights
