"""Load a model's weights into our modules (where its files are, and a GGUF file's conversion:
engine/weights/paths.py)."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import torch
from safetensors import safe_open

from engine.errors import ModelLoadError
from engine.layers.linear import STACKED, copy_checked
from engine.layers.moe import MOE_IMPLS
from engine.models import has_native, model_class
from engine.models.config import ModelConfig
from engine.pipeline.grid import Pipe
from engine.pipeline.split import split_for_stage, trim_to_stage
from engine.pipeline.stage import PipelineStage
from engine.weights.fallback import load_transformers_model
from engine.weights.paths import (  # noqa: F401 - the loader's callers find the paths here too
    EMBEDDED_GGUF,
    EMBEDDED_PACKAGE,
    convert_gguf,
    embedded_gguf_path,
    gguf_file,
    resolve_model_dir,
)
from engine.weights.placement import Placement

IGNORED_WEIGHTS = ("rotary_emb.inv_freq",)
QUANT_SCALES = (".weight_scale", ".input_scale")
IMPLEMENTATIONS = ("auto", "native", "transformers")


@dataclass
class LoadedModel:
    model: torch.nn.Module
    config: ModelConfig
    tokenizer: object
    path: Path
    eos_token_ids: frozenset[int]


def _raw_config(model_dir: Path) -> dict:
    try:
        return json.loads((model_dir / "config.json").read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise ModelLoadError(f"cannot read {model_dir / 'config.json'}: {err}") from None


def read_config(model_dir: Path) -> ModelConfig:
    return ModelConfig.from_hf(_raw_config(model_dir))


def read_architecture(model_dir: Path) -> str:
    return (_raw_config(model_dir).get("architectures") or [""])[0]


def weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        files = [model_dir / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ModelLoadError(
                f"weight files listed in {index.name} are missing: {', '.join(missing)}"
            )
        return files
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"no *.safetensors weight files in {model_dir}")
    return files


def build_model(
    config: ModelConfig, placement: Placement, max_positions: int, pipe: Pipe | None = None
):
    """Our module for `config` (this rank's part of it), allocated without a random init.
    `pipe`: this rank's pipeline stage; the model then holds the stage's layers only."""
    dtype, device, parallel, moe_impl = (
        placement.dtype,
        placement.device,
        placement.parallel,
        placement.moe_impl,
    )
    cls = model_class(config.architecture)
    stage_weights = None
    if pipe is not None:
        config, stage_weights = split_for_stage(config, pipe.stage, pipe.stages)
    if moe_impl not in MOE_IMPLS:
        raise ModelLoadError(
            f"unknown MoE implementation {moe_impl!r} (choose from {', '.join(MOE_IMPLS)})"
        )
    try:
        with torch.device("meta"):
            model = cls(config, max_positions, parallel, moe_impl=moe_impl).to(dtype)
    except ValueError as err:  # heads or sizes that do not divide over the shards
        raise ModelLoadError(
            f"{config.architecture} cannot be sharded {parallel.world_size} ways: {err}"
        ) from None
    if stage_weights is not None:
        trim_to_stage(model, stage_weights)
    model.to_empty(device=device)
    # to_empty may give the tied parameter two storages
    if config.tie_word_embeddings and model.lm_head is not None:
        model.lm_head.weight = model.embed_tokens.weight
    model.rebuild_rotary(max_positions, device)
    if stage_weights is not None:
        model.stage_weights = stage_weights
        model.stage = PipelineStage(pipe, config.hidden_size, config.vocab_size, dtype)
    return model.eval()


def load_weights(model: torch.nn.Module, files: list[Path]) -> None:
    """Fill the model from safetensors files, each rank reading only its own slices."""
    unfilled = _expected_pieces(model)
    stage = getattr(model, "stage_weights", None)  # a pipeline stage reads its own tensors only
    for file in files:
        try:
            with safe_open(file, framework="pt") as reader:
                for name in reader.keys():
                    short = name.removeprefix("model.")
                    local = short if stage is None else stage.local_name(short)
                    if local is not None:
                        unfilled.difference_update(_load_one(model, local, reader.get_slice(name)))
        except ModelLoadError:
            raise
        except Exception as err:  # safetensors reports corruption with its own error types
            raise ModelLoadError(f"weight file {file} is corrupt or unreadable: {err}") from None
    if unfilled:
        names = sorted({name for name, _ in unfilled})
        raise ModelLoadError(f"weights missing from {files[0].parent}: {', '.join(names[:8])}")


def _expected_pieces(model) -> set[tuple[str, object]]:
    """(parameter, part) pairs the checkpoint must fill; part is None for unfused parameters."""
    pieces = set()
    for name, _ in model.named_parameters():
        module_name, _, kind = name.rpartition(".")
        module = model.get_submodule(module_name)
        if hasattr(module, "checkpoint_parts"):  # MoE experts: one checkpoint tensor per expert
            parts = module.checkpoint_parts(kind)
        else:
            parts = getattr(module, "parts", None)
        pieces |= {(name, part) for part in parts} if parts else {(name, None)}
    return pieces


def _load_one(model, name: str, source) -> list[tuple[str, object]]:
    """Copy one checkpoint tensor (this rank's slice of it) into its parameter; returns the pieces
    filled."""
    if name.endswith(IGNORED_WEIGHTS) or (
        name == "lm_head.weight" and model.config.tie_word_embeddings
    ):
        return []
    module_name, kind, part = model.checkpoint_target(name)
    if name.endswith(
        QUANT_SCALES
    ):  # read with their FP8 weights (load_fp8); activation scales unused
        if getattr(model.get_submodule(module_name), "quantized", None) is None:
            raise ModelLoadError(
                f"checkpoint tensor {name!r}: this is a pre-quantized FP8 checkpoint; "
                "serve it with --quantize fp8"
            )
        return []
    try:
        module = model.get_submodule(module_name)
        param = getattr(module, kind)
    except AttributeError:  # a tensor of no module of ours (an unrelated checkpoint)
        module = param = None
    if kind == "weight" and getattr(module, "quantized", None) is not None:
        return []  # filled from the GGUF file's own blocks (engine.weights.quantize)
    if not isinstance(param, torch.nn.Parameter):
        raise ModelLoadError(f"checkpoint tensor {name!r} matches no parameter of the model")
    if part == STACKED:
        module.load_stacked(kind, source, name)
        return [(f"{module_name}.{kind}", each) for each in module.parts]
    if hasattr(module, "load"):
        module.load(kind, part, source, name)
    else:  # replicated on every rank (norms, MoE routers)
        copy_checked(param, source, slice(None), tuple(param.shape), name)
    return [(f"{module_name}.{kind}", part)]


def load_quantized(
    model_id, model_dir: Path, config: ModelConfig, placement: Placement
) -> torch.nn.Module:
    """A native model with quantized linear weights: straight from a Llama GGUF file's blocks, else
    quantized from the float32 checkpoint (the norms and other small weights come from
    model_dir)."""
    from engine.weights.gguf import read_weights
    from engine.weights.quantize import QUANTIZE_MODES, WEIGHT_ONLY, quantize_model

    mode, dtype = placement.quantize, placement.dtype
    if mode not in QUANTIZE_MODES:
        raise ModelLoadError(
            f"unknown quantization {mode!r} (choose from {', '.join(QUANTIZE_MODES)})"
        )
    if mode not in WEIGHT_ONLY:
        return load_fp8(model_dir, config, placement)
    if config.moe is not None:
        raise ModelLoadError(
            f"--quantize {mode} covers dense models only (MoE experts are not quantized yet)"
        )
    gguf = gguf_file(model_id)
    direct = gguf is not None and config.architecture == "LlamaForCausalLM"
    built_in = placement if direct else replace(placement, dtype=torch.float32)
    model = build_model(config, built_in, config.max_position_embeddings)
    if direct:
        quantize_model(
            model, mode, dtype, read_weights(gguf, config.num_heads, config.num_kv_heads)
        )
        load_weights(model, weight_files(model_dir))  # the rest: norms
    else:
        load_weights(model, weight_files(model_dir))
        quantize_model(model, mode, dtype)
        with torch.no_grad():
            for param in model.parameters():
                param.data = param.data.to(dtype)
    return model


def load_fp8(model_dir: Path, config: ModelConfig, placement: Placement) -> torch.nn.Module:
    """A pre-quantized FP8 checkpoint: its float8_e4m3fn linear weights and their weight_scale
    tensors become Fp8Weights (engine/layers/fp8.py); everything else loads as usual, in `dtype`."""
    from engine.weights.quantize import fp8_quantize_model

    files = weight_files(model_dir)
    fp8, scales = {}, {}
    for file in files:
        with safe_open(file, framework="pt") as reader:
            for name in reader.keys():
                short = name.removeprefix("model.")
                if name.endswith("weight_scale"):
                    scales[short] = reader.get_tensor(name)
                elif reader.get_slice(name).get_dtype() == "F8_E4M3":
                    fp8[short] = reader.get_tensor(name)
    model = build_model(config, placement, config.max_position_embeddings)
    if not fp8 or fp8_quantize_model(model, fp8, scales) == 0:
        raise ModelLoadError(f"--quantize fp8: {model_dir} holds no float8_e4m3fn linear weights")
    load_weights(model, files)
    return model


def check_pipeline_supported(architecture: str, fallback: bool, quantize: str) -> None:
    """Pipeline stages are native float models (the fallback's and the quantized loaders' models
    are whole)."""
    if fallback:
        raise ModelLoadError(
            f"--pipeline-parallel-size needs a native model; {architecture or 'this model'} "
            "is served by the transformers fallback"
        )
    if quantize != "none":
        raise ModelLoadError("--pipeline-parallel-size does not combine with --quantize yet")


def eos_token_ids(model_dir: Path, config: ModelConfig, tokenizer) -> frozenset[int]:
    ids = set(config.eos_token_ids)
    generation = model_dir / "generation_config.json"
    if generation.is_file():
        value = json.loads(generation.read_text()).get("eos_token_id")
        ids.update([value] if isinstance(value, int) else value or [])
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)


def load(
    model_id: str | None,
    cache_dir: Path,
    placement: Placement,
    *,
    implementation: str = "auto",
    prepare_fallback=None,
    pipe: Pipe | None = None,
) -> LoadedModel:
    """`implementation`: native (ours), transformers (the fallback) or auto (native when we have
    one). `prepare_fallback(cls)`: the device's hook before the fallback builds its class
    (DeviceAdapter.prepare_transformers). `placement`: its dtype, device, parallel part, MoE kernel
    and quantization."""
    from transformers import AutoTokenizer

    model_dir = resolve_model_dir(model_id, cache_dir)
    architecture = read_architecture(model_dir)
    if implementation not in IMPLEMENTATIONS:
        raise ModelLoadError(
            f"unknown implementation {implementation!r} (choose from {', '.join(IMPLEMENTATIONS)})"
        )
    fallback = implementation == "transformers" or (
        implementation == "auto" and not has_native(architecture)
    )
    if pipe is not None:
        check_pipeline_supported(architecture, fallback, placement.quantize)
    if fallback:
        model, config = load_transformers_model(model_dir, placement, prepare_fallback)
    elif placement.quantize != "none":
        config = read_config(model_dir)
        model = load_quantized(model_id, model_dir, config, placement)
    else:
        config = read_config(model_dir)
        model = build_model(config, placement, config.max_position_embeddings, pipe)
        config = model.config  # a pipeline stage's: its layers only (the KV cache's size)
        load_weights(model, weight_files(model_dir))
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
    except Exception as err:
        raise ModelLoadError(f"cannot load the tokenizer from {model_dir}: {err}") from None
    return LoadedModel(
        model, config, tokenizer, model_dir, eos_token_ids(model_dir, config, tokenizer)
    )
