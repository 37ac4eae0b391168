"""Load PEFT LoRA adapters from local directories into the model's projections.

An adapter directory holds `adapter_config.json` and `adapter_model.safetensors` with tensors named
like `base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight` ([r, in]) and
`...lora_B.weight` ([out, r]). Each projection gets one LoraWeights holding every adapter, padded to
the largest rank loaded (every adapter is known at start, so that rank fixes the shapes for good).
Under tensor parallelism each rank reads only its slice, split like the base weight it adapts: B's
rows for a column-parallel projection, A's columns for a row-parallel one.
"""

from __future__ import annotations

import json
import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from engine.distributed import SINGLE, Parallel
from engine.errors import ModelLoadError
from engine.layers.linear import ColumnParallelLinear, RowParallelLinear
from engine.layers.lora import LoraOps, LoraSet, LoraWeights, lora_ops

log = logging.getLogger(__name__)

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
SUPPORTED_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_TENSOR_NAME = re.compile(
    r"^(?:base_model\.model\.)?(?:model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$"
)
# PEFT features that change the math beyond x·Aᵀ·Bᵀ·scale: refused rather than served wrongly.
_UNSUPPORTED = {
    "use_dora": "DoRA",
    "modules_to_save": "modules_to_save",
    "rank_pattern": "rank_pattern",
    "alpha_pattern": "alpha_pattern",
    "layer_replication": "layer_replication",
    "lora_bias": "lora_bias",
}


@dataclass(frozen=True)
class PeftAdapter:
    name: str
    path: Path
    rank: int
    scale: float  # lora_alpha / r, or lora_alpha / sqrt(r) with rsLoRA
    base_model: str | None
    modules: dict[
        str, dict[str, str]
    ]  # "layers.0.self_attn.q_proj" -> {"A": tensor name, "B": ...}


def read_adapter(name: str, path: str | Path, max_rank: int) -> PeftAdapter:
    """An adapter's config and tensor names, checked before any weight is read."""
    path = Path(path)
    if not path.is_dir():
        raise ModelLoadError(
            f"LoRA adapter {name!r}: directory {path} not found (adapters are not downloaded from "
            "a hub)"
        )
    for required in (CONFIG_FILE, WEIGHTS_FILE):
        if not (path / required).is_file():
            raise ModelLoadError(f"LoRA adapter {name!r}: {path} has no {required}")
    config = _read_config(name, path)
    rank, alpha = int(config.get("r", 8)), float(config.get("lora_alpha", 8))
    if not 0 < rank <= max_rank:
        raise ModelLoadError(
            f"LoRA adapter {name!r}: rank {rank} exceeds --max-lora-rank {max_rank}"
        )
    scale = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    with safe_open(path / WEIGHTS_FILE, framework="pt") as reader:
        modules = _modules(name, list(reader.keys()))
    return PeftAdapter(name, path, rank, scale, config.get("base_model_name_or_path"), modules)


def _read_config(name: str, path: Path) -> dict:
    try:
        config = json.loads((path / CONFIG_FILE).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ModelLoadError(
            f"LoRA adapter {name!r}: cannot read {path / CONFIG_FILE}: {err}"
        ) from None
    if config.get("peft_type", "LORA") != "LORA":
        raise ModelLoadError(
            f"LoRA adapter {name!r}: peft_type {config['peft_type']!r} is not LORA"
        )
    used = [label for key, label in _UNSUPPORTED.items() if config.get(key)]
    if config.get("bias", "none") != "none":
        used.append(f"bias={config['bias']!r}")
    if used:
        raise ModelLoadError(f"LoRA adapter {name!r}: {', '.join(used)} is not supported")
    return config


def _modules(name: str, keys: list[str]) -> dict[str, dict[str, str]]:
    """Adapted module -> its A and B tensor names; anything but q/k/v/o/gate/up/down is refused."""
    modules: dict[str, dict[str, str]] = {}
    for key in keys:
        match = _TENSOR_NAME.match(key)
        target = match["module"].rpartition(".")[2] if match else key
        if not match or target not in SUPPORTED_TARGETS:
            raise ModelLoadError(
                f"LoRA adapter {name!r}: tensor {key!r} adapts a module that is not supported "
                f"(supported: {', '.join(SUPPORTED_TARGETS)})"
            )
        modules.setdefault(match["module"], {})[match["ab"]] = key
    for module, pair in modules.items():
        if set(pair) != {"A", "B"}:
            raise ModelLoadError(
                f"LoRA adapter {name!r}: module {module} has lora_{''.join(pair)} but not both A "
                "and B"
            )
    if not modules:
        raise ModelLoadError(f"LoRA adapter {name!r}: {WEIGHTS_FILE} holds no LoRA weights")
    return modules


def attach_adapters(
    model,
    specs: tuple[tuple[str, str], ...],
    max_rank: int,
    ops: LoraOps,
    parallel: Parallel = SINGLE,
) -> LoraSet:
    """Read every adapter and give each adapted projection of `model` its LoraWeights."""
    adapters = [read_adapter(name, path, max_rank) for name, path in specs]
    lora_set = LoraSet(tuple(a.name for a in adapters), max(a.rank for a in adapters), ops)
    targets: dict[str, set] = {}
    for adapter in adapters:
        for module in adapter.modules:
            fused, _, part = model.checkpoint_target(f"{module}.weight")
            targets.setdefault(fused, set()).add(part)
    for fused, parts in targets.items():
        layer = _projection(model, fused, adapters)
        layer.lora = _layer_weights(model, layer, fused, parts, adapters, lora_set, parallel)
    model.lora_set = lora_set
    log.info(
        "LoRA adapters %s (rank %d, %s) on %d projections",
        ", ".join(lora_set.names),
        lora_set.rank,
        ops.name,
        len(targets),
    )
    return lora_set


def _projection(model, fused: str, adapters: list[PeftAdapter]):
    try:
        layer = model.get_submodule(fused)
    except AttributeError:
        layer = None
    if not isinstance(layer, (ColumnParallelLinear, RowParallelLinear)):
        names = ", ".join(
            a.name
            for a in adapters
            if any(model.checkpoint_target(f"{m}.weight")[0] == fused for m in a.modules)
        )
        raise ModelLoadError(
            f"LoRA adapter {names}: module {fused} is not in the base model "
            f"({model.config.num_layers} layers); was it trained for another base model?"
        )
    return layer


def _layer_weights(
    model,
    layer,
    fused: str,
    parts: set,
    adapters: list[PeftAdapter],
    lora_set: LoraSet,
    parallel: Parallel,
) -> LoraWeights:
    """[adapters, parts, rank, in] A and per-part [adapters, out, rank] B, zero where an adapter is
    absent."""
    order = (
        [p for p in layer.parts if p in parts]
        if isinstance(layer, ColumnParallelLinear)
        else [None]
    )
    width = layer.in_features if isinstance(layer, ColumnParallelLinear) else layer.local_in
    a = torch.zeros(len(adapters), len(order), lora_set.rank, width)
    b = [torch.zeros(len(adapters), _local_rows(layer, part), lora_set.rank) for part in order]
    for slot, adapter in enumerate(adapters):
        modules = {model.checkpoint_target(f"{m}.weight")[::2]: m for m in adapter.modules}
        with safe_open(adapter.path / WEIGHTS_FILE, framework="pt") as reader:
            for index, part in enumerate(order):
                if (fused, part) in modules:
                    module = modules[(fused, part)]
                    a_slice, b_slice = _read_pair(reader, adapter, module, layer, part, parallel)
                    a[slot, index, : adapter.rank] = a_slice
                    b[index][slot, :, : adapter.rank] = b_slice * adapter.scale
    offsets = [layer.offsets[p] for p in order] if order != [None] else [0]
    to = dict(dtype=layer.weight.dtype, device=layer.weight.device)
    return LoraWeights(lora_set.ops, a.to(**to), [part.to(**to) for part in b], offsets)


def _local_rows(layer, part) -> int:
    return layer.parts[part][2] if part is not None else layer.out_features


def _read_pair(reader, adapter: PeftAdapter, module: str, layer, part, parallel: Parallel):
    """This rank's slices of one module's A and B, after checking their full shapes against the
    base."""
    rank, keys = adapter.rank, adapter.modules[module]
    if part is not None:  # column-parallel: every rank needs all of A and its own rows of B
        rows, start, local = layer.parts[part]
        a_shape, a_index = (rank, layer.in_features), (slice(None),)
        b_shape, b_index = (rows, rank), (slice(start, start + local),)
    else:  # row-parallel: A's columns follow the base weight's input split; B is whole
        start = parallel.rank * layer.local_in
        a_shape, a_index = (
            (rank, layer.local_in * parallel.world_size),
            (slice(None), slice(start, start + layer.local_in)),
        )
        b_shape, b_index = (layer.out_features, rank), (slice(None),)
    return (
        _read_checked(reader, adapter, module, keys["A"], a_shape, a_index),
        _read_checked(reader, adapter, module, keys["B"], b_shape, b_index),
    )


def _read_checked(
    reader, adapter: PeftAdapter, module: str, key: str, shape: tuple, index
) -> torch.Tensor:
    source = reader.get_slice(key)
    found = tuple(source.get_shape())
    if found != shape:
        base = f" (trained for {adapter.base_model})" if adapter.base_model else ""
        raise ModelLoadError(
            f"LoRA adapter {adapter.name!r}{base}: {key} has shape {found}, but module {module} "
            f"of the base model needs {shape}; was it trained for another base model?"
        )
    return source[index].float()


def load_adapters(model, config, default_impl: str, parallel: Parallel = SINGLE) -> LoraSet | None:
    """The configured adapters attached to `model` (None when none are configured); the LoRA
    implementation is config.lora_impl, else the device's default."""
    if not config.lora_adapters:
        return None
    return attach_adapters(
        model,
        config.lora_adapters,
        config.max_lora_rank,
        lora_ops(config.lora_impl or default_impl),
        parallel,
    )
