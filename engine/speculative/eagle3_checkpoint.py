"""An EAGLE-3 checkpoint: its config.json checked against the target, and its weights read into
the head (engine/speculative/eagle3.py), in vLLM's names and layout (vllm/model_executor/models/
llama_eagle3.py at commit 00bd1493b3e82d6c13c68ee8a0e1c5a96707e190): `midlayer.*` or `layers.0.*`,
`fc`, `norm`, `lm_head` over the draft vocabulary, `d2t`, optionally `embed_tokens`."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from engine.distributed import SINGLE
from engine.errors import ModelLoadError
from engine.layers.embedding import VocabParallelEmbedding
from engine.layers.linear import copy_checked, shape_of
from engine.models.config import ModelConfig

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
AUX_STATES = 3  # low, middle and high layers of the target


@dataclass(frozen=True)
class Eagle3Config:
    """What an EAGLE-3 config.json says, checked against the target."""

    layer: ModelConfig  # the head's decoder layer, parsed as a Llama config
    draft_vocab_size: int
    target_hidden_size: int
    norm_before_residual: bool
    aux_layers: tuple[int, ...]  # distinct and ascending: the order the target stores them in


def default_aux_layers(num_layers: int) -> tuple[int, ...]:
    """vLLM's choice (LlamaForCausalLM.get_eagle3_aux_hidden_state_layers)."""
    return (2, num_layers // 2, num_layers - 3)


def parse_config(raw: dict, target_config: ModelConfig, path) -> Eagle3Config:
    architectures = raw.get("architectures") or []
    if not any(name in ARCHITECTURES for name in architectures):
        raise ModelLoadError(
            f"--draft-model {path}: config.json names {architectures or 'no architecture'}, not "
            f"an EAGLE-3 head ({' or '.join(ARCHITECTURES)})"
        )
    if raw.get("num_hidden_layers", 1) != 1:
        raise ModelLoadError(f"--draft-model {path}: an EAGLE-3 head of one layer is supported")
    eagle = raw.get("eagle_config") or {}
    if not eagle.get("use_aux_hidden_state", True):
        raise ModelLoadError(f"--draft-model {path}: heads without aux hidden states (EAGLE-1/2)")
    try:
        layer = ModelConfig.from_hf({**raw, "architectures": ["LlamaForCausalLM"]})
    except ModelLoadError as err:
        raise ModelLoadError(f"--draft-model {path}: {err}") from None
    target_hidden = raw.get("target_hidden_size") or raw["hidden_size"]
    if target_hidden != target_config.hidden_size:
        raise ModelLoadError(
            f"--draft-model {path}: an EAGLE-3 head for hidden size {target_hidden}, the "
            f"target's is {target_config.hidden_size}"
        )
    if layer.vocab_size != target_config.vocab_size:
        raise ModelLoadError(
            f"--draft-model {path}: an EAGLE-3 head for a vocabulary of {layer.vocab_size} "
            f"tokens, the target's has {target_config.vocab_size}"
        )
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or eagle.get(
        "eagle_aux_hidden_state_layer_ids"
    )
    aux = tuple(ids) if ids else default_aux_layers(target_config.num_layers)
    if len(set(aux)) != AUX_STATES or not all(0 <= i < target_config.num_layers for i in aux):
        raise ModelLoadError(
            f"--draft-model {path}: aux hidden state layers {list(aux)} are not three distinct "
            f"layers of the target's {target_config.num_layers}"
        )
    return Eagle3Config(
        layer,
        raw.get("draft_vocab_size") or layer.vocab_size,
        target_hidden,
        bool(raw.get("norm_before_residual", False)),
        tuple(sorted(aux)),
    )


def _read_weights(path: Path) -> dict:
    files = sorted(path.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        weights = {}
        for file in files:
            weights.update(load_file(str(file)))
        return weights
    bins = sorted(path.glob("*.bin"))
    if not bins:
        raise ModelLoadError(f"--draft-model {path}: no *.safetensors or *.bin weight files")
    weights = {}
    for file in bins:
        weights.update(torch.load(file, map_location="cpu", weights_only=True))
    return weights


def _canonical(name: str) -> str:
    """vLLM's names: `midlayer.` is `layers.0.`; a `model.` prefix is dropped."""
    name = name.removeprefix("model.")
    return name.replace("midlayer.", "layers.0.")


STACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v")}
MERGED = {"gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}


REQUIRED = (
    *(f"layers.0.self_attn.{p}_proj.weight" for p in "qkvo"),
    *(f"layers.0.mlp.{p}_proj.weight" for p in ("gate", "up", "down")),
    *(
        f"layers.0.{n}.weight"
        for n in ("input_layernorm", "hidden_norm", "post_attention_layernorm")
    ),
    "norm.weight",
)


def _load_into(head, config: Eagle3Config, weights: dict, path) -> None:
    weights = {_canonical(k): v for k, v in weights.items() if "t2d" not in k}
    layer = config.layer
    if "d2t" not in weights and config.draft_vocab_size != layer.vocab_size:
        raise ModelLoadError(f"--draft-model {path}: a reduced draft vocabulary without d2t")
    if "d2t" in weights:
        _load_d2t(head, weights.pop("d2t"), config, path)
    if "embed_tokens.weight" in weights:
        head.embed_tokens = VocabParallelEmbedding(layer.vocab_size, layer.hidden_size, SINGLE)
        head.embed_tokens.load("weight", None, weights.pop("embed_tokens.weight"), "embed_tokens")
    elif layer.hidden_size != config.target_hidden_size:
        raise ModelLoadError(
            f"--draft-model {path}: no embed_tokens, and the target's differ in size"
        )
    if "lm_head.weight" in weights:
        source = weights.pop("lm_head.weight")
        expected = (config.draft_vocab_size, layer.hidden_size)
        head.lm_head = nn.Parameter(torch.empty(expected))
        copy_checked(head.lm_head.data, source, slice(None), expected, "lm_head.weight")
    elif (
        config.draft_vocab_size != layer.vocab_size
        or layer.hidden_size != config.target_hidden_size
    ):
        raise ModelLoadError(f"--draft-model {path}: no lm_head, and the target's does not fit")
    expected_fc = (layer.hidden_size, AUX_STATES * config.target_hidden_size)
    copy_checked(
        head.fc.data,
        weights.pop("fc.weight", torch.empty(0)),
        slice(None),
        expected_fc,
        "fc.weight",
    )
    missing = sorted(set(REQUIRED) - set(weights))
    if missing:
        raise ModelLoadError(f"--draft-model {path}: the checkpoint lacks {', '.join(missing)}")
    modules = dict(head.named_modules())
    for name, tensor in weights.items():
        module_name, _, kind = name.rpartition(".")
        part = None
        for fragment, (fused, which) in {**STACKED, **MERGED}.items():
            if module_name.endswith(fragment):
                module_name, part = module_name[: -len(fragment)] + fused, which
                break
        module = modules.get(module_name)
        if module is None or not hasattr(module, kind) and not hasattr(module, "load"):
            raise ModelLoadError(f"--draft-model {path}: unexpected tensor {name!r}")
        if hasattr(module, "load"):
            module.load(kind, part, tensor, name)
        else:
            dest = getattr(module, kind)
            copy_checked(dest.data, tensor, slice(None), tuple(dest.shape), name)


def _load_d2t(head, d2t, config: Eagle3Config, path) -> None:
    d2t = torch.as_tensor(d2t).long()
    if shape_of(d2t) != (config.draft_vocab_size,):
        raise ModelLoadError(
            f"--draft-model {path}: d2t has {d2t.numel()} entries for a draft vocabulary of "
            f"{config.draft_vocab_size}"
        )
    targets = torch.arange(config.draft_vocab_size) + d2t
    if int(targets.min()) < 0 or int(targets.max()) >= config.layer.vocab_size:
        raise ModelLoadError(f"--draft-model {path}: d2t maps outside the target's vocabulary")
    head.d2t.copy_(d2t)


def load_weights(head, config: Eagle3Config, path: Path) -> None:
    """The checkpoint's tensors into `head` (an Eagle3Head), every shape checked."""
    _load_into(head, config, _read_weights(path), path)
