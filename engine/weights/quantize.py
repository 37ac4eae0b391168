"""--quantize: replace a loaded model's linear weights by weight-only quantized ones.

int4 and int8 run on PyTorch's CPU kernels (engine/layers/quant.py). The projections of the
decoder layers take the mode's form; the vocabulary matrices (embedding and LM head, often one
tied tensor) always take int8 per row, whose plain rows also serve the embedding lookup.

From a GGUF file (Llama architecture) the Q4_0/Q4_1 blocks go into int4 as they are: their codes,
scales and zeros are the kernel's (the scales rounded to the serving dtype). Any other GGUF type
(Q8_0's 32-weight scales, which the per-row int8 kernel cannot hold, F16, ...) is dequantized and
quantized to the target form. fp8 checkpoints are engine/layers/fp8.py's.
"""

from __future__ import annotations

import torch

from engine.errors import ModelLoadError
from engine.layers.embedding import VocabParallelEmbedding
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.layers.quant import Int4Weight, int4_groupwise, int8_per_channel
from engine.weights.gguf import GgufInt4

QUANTIZE_MODES = ("none", "int8", "int4", "fp8")
WEIGHT_ONLY = ("int8", "int4")


def quantize_model(
    model: torch.nn.Module, mode: str, dtype: torch.dtype, gguf: dict | None = None
) -> None:
    """Quantize every linear and vocabulary weight of `model` in place. `gguf`: the file's weights
    by checkpoint name (engine.weights.gguf.read_weights); without it the model's loaded weights are
    used."""
    names = _checkpoint_names(model) if gguf is not None else {}
    for module_name, module in list(model.named_modules()):
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding)):
            if (
                module is model.lm_head and model.config.tie_word_embeddings
            ):  # shares the embedding's
                module.quantized = model.embed_tokens.quantized
                module.register_parameter("weight", None)
                continue
            source = (
                _local_source(module, module_name, gguf, names)
                if gguf is not None
                else module.weight.detach()
            )
            module.quantized = _quantized(
                source, mode, dtype, isinstance(module, VocabParallelEmbedding)
            )
            module.register_parameter("weight", None)


def _quantized(source, mode: str, dtype: torch.dtype, vocabulary: bool):
    if vocabulary or mode == "int8":
        values = source.dequantize() if isinstance(source, GgufInt4) else source
        return int8_per_channel(values, dtype)
    if isinstance(source, GgufInt4):  # the file's own codes and groups
        return Int4Weight(source.codes, source.scale, source.zero, 32, dtype)
    return int4_groupwise(source, dtype)


def _checkpoint_names(model) -> dict[str, dict]:
    """module name -> {part: checkpoint name} over every decoder linear and vocabulary matrix."""
    targets: dict[str, dict] = {}
    for name in _expected_weight_names(model):
        module_name, kind, part = model.checkpoint_target(name)
        targets.setdefault(module_name, {})[part] = name
    return targets


def _expected_weight_names(model) -> list[str]:
    """The checkpoint names of a Llama-layout model's matrices."""
    names = ["embed_tokens.weight"] + (
        [] if model.config.tie_word_embeddings else ["lm_head.weight"]
    )
    for i in range(model.config.num_layers):
        names += [f"layers.{i}.self_attn.{p}_proj.weight" for p in ("q", "k", "v", "o")]
        names += [f"layers.{i}.mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
    return names


def _local_source(module, module_name: str, gguf: dict, names: dict):
    """This rank's part of the GGUF weight of `module` (int4 codes, or float32 values)."""
    parts = names.get(module_name)
    missing = [n for n in (parts or {}).values() if n not in gguf]
    if not parts or missing:
        raise ModelLoadError(
            f"the GGUF file lacks the weights of {module_name} ({', '.join(missing) or 'all'})"
        )
    if isinstance(module, ColumnParallelLinear):
        pieces = [
            _rows(gguf[parts[part]], slice(start, start + local))
            for part, (_, start, local) in module.parts.items()
        ]
        return (
            GgufInt4.cat(pieces)
            if all(isinstance(p, GgufInt4) for p in pieces)
            else torch.cat([p.dequantize() if isinstance(p, GgufInt4) else p for p in pieces])
        )
    source = gguf[parts[None]]
    if isinstance(module, RowParallelLinear):
        start = module.parallel.rank * module.local_in
        if isinstance(source, GgufInt4):
            return source.columns(start, start + module.local_in)
        return source[:, start : start + module.local_in]
    rows = source.dequantize() if isinstance(source, GgufInt4) else source  # vocabulary: int8 rows
    local = torch.zeros(module.rows_per_rank, module.hidden_size)
    local[: module.end - module.start] = rows[module.start : module.end]
    return local


def _rows(source, index):
    return source.rows(index) if isinstance(source, GgufInt4) else source[index]


def fp8_quantize_model(
    model: torch.nn.Module, fp8: dict[str, torch.Tensor], scales: dict[str, torch.Tensor]
) -> int:
    """Give every linear layer whose checkpoint weights are FP8 (`fp8`, by checkpoint name without
    "model.") an Fp8Weight of this rank's rows or columns, with its `scales` ("...weight_scale")
    per row. Returns the layers converted; the others (and the vocabulary) stay in float."""
    from engine.layers.fp8 import Fp8Weight, row_scales

    converted = 0
    for module_name, parts in _checkpoint_names(model).items():
        module = model.get_submodule(module_name)
        if isinstance(module, VocabParallelEmbedding) or not all(n in fp8 for n in parts.values()):
            continue
        pieces = []
        for part, name in parts.items():
            scale_name = name.removesuffix("weight") + "weight_scale"
            if scale_name not in scales:
                raise ModelLoadError(f"the FP8 checkpoint has {name} but no {scale_name}")
            rows = row_scales(scales[scale_name], fp8[name].shape[0])
            if isinstance(module, ColumnParallelLinear):
                _, start, local = module.parts[part]
                pieces.append((fp8[name][start : start + local], rows[start : start + local]))
            else:
                start = module.parallel.rank * module.local_in
                pieces.append((fp8[name][:, start : start + module.local_in], rows))
        module.quantized = Fp8Weight(
            torch.cat([w for w, _ in pieces]), torch.cat([s for _, s in pieces])
        )
        module.register_parameter("weight", None)
        converted += 1
    return converted
