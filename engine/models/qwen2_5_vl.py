"""Qwen2.5-VL: transformers' own vision tower and patch merger (replicated on every rank) beside our
native Qwen2 decoder with multimodal rope (M-RoPE, engine/layers/mrope.py). An image runs through
the tower at its planned grid (engine/vision/grids.py) and its features take the places of its
image tokens in the prompt's embeddings.

Inputs past the text model's (after the LoRA index, where adapters are loaded): in a prefill, the
image embeddings [rows, width, hidden] and the M-RoPE positions [3, rows, width]; in a decode,
each row's position delta [rows] (the rope turns at position + delta on all three rows), so every
bucket keeps its one static shape."""

from __future__ import annotations

import torch

from engine.distributed import SINGLE, Parallel
from engine.layers.mrope import mrope_cos_sin
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM


class Qwen2_5_VLForConditionalGeneration(LlamaForCausalLM):
    takes_images = True  # the runner passes image embeddings to its prefills
    takes_mrope = True  # and 3-row positions to its prefills, position deltas to its decodes

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        parallel: Parallel = SINGLE,
        moe_impl: str = "dense",
    ):
        super().__init__(config, max_positions, parallel, moe_impl)
        from transformers import Qwen2_5_VLConfig
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
            Qwen2_5_VisionTransformerPretrainedModel,
        )

        hf = Qwen2_5_VLConfig(**config.vision)
        self.image_token_id = hf.image_token_id
        rope = hf.text_config.rope_parameters or {}
        self.mrope_section = tuple(rope.get("mrope_section") or (16, 24, 24))
        tower = hf.vision_config
        self.patch_width = (
            tower.in_channels * tower.temporal_patch_size * tower.patch_size * tower.patch_size
        )
        with torch.device("cpu"):  # its buffers are computed here, then kept through to_empty
            self.visual = Qwen2_5_VisionTransformerPretrainedModel._from_config(tower)
        persistent = set(self.visual.state_dict())
        self._tower_buffers = {
            name: buffer.clone()
            for name, buffer in self.visual.named_buffers()
            if name not in persistent
        }
        self._images: torch.Tensor | None = None
        self._rope_positions: torch.Tensor | None = None

    def rebuild_rotary(self, max_positions: int, device) -> None:
        super().rebuild_rotary(max_positions, device)
        for name, value in self._tower_buffers.items():  # to_empty left them uninitialized
            module, _, attr = name.rpartition(".")
            owner = self.visual.get_submodule(module) if module else self.visual
            getattr(owner, attr).copy_(value.to(device))

    def checkpoint_target(self, name: str) -> tuple[str, str, object]:
        """Hub checkpoints name the text model `model.*` and the tower `visual.*`; transformers'
        newer layout `model.language_model.*` and `model.visual.*` (the loader drops `model.`)."""
        name = name.removeprefix("language_model.")
        if name.startswith("visual."):  # transformers' own modules, as they are
            module, _, kind = name.rpartition(".")
            return module, kind, None
        return super().checkpoint_target(name)

    @torch.inference_mode()
    def image_features(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[tokens, hidden] of one image's [patches, patch width] at its grid [1, 3] (t, h, w in
        patches), as transformers' Qwen2_5_VLModel.get_image_features computes them."""
        dtype = self.visual.patch_embed.proj.weight.dtype
        return self.visual(pixel_values.to(dtype), grid_thw=grid_thw).pooler_output

    def forward(self, input_ids, positions, meta, logits_indices, *extra) -> torch.Tensor:
        lora_count = 1 if self.lora_set is not None else 0
        lora = extra[0] if lora_count else None
        rest = extra[lora_count:]
        if positions.dim() == 1:  # a decode: [rows] positions, then each row's delta
            self._rope_positions = positions + rest[0] if rest else None
        elif rest:  # a prefill: the image embeddings, then the 3-row positions
            self._images, self._rope_positions = rest
        try:
            return super().forward(input_ids, positions, meta, logits_indices, lora)
        finally:
            self._images = self._rope_positions = None

    def layer_contexts(self, positions, meta, dtype):
        contexts = super().layer_contexts(positions, meta, dtype)
        turned = self._rope_positions
        if turned is None:
            return contexts
        if turned.dim() == positions.dim():  # a decode: all three rows at position + delta
            rope = self.rotary.cos_sin(turned, dtype)
        else:
            rope = mrope_cos_sin(self.rotary, turned, self.mrope_section, dtype)
        return {kind: context._replace(rope=rope) for kind, context in contexts.items()}

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().embed(input_ids)
        if self._images is None:
            return hidden
        places = (input_ids == self.image_token_id).unsqueeze(-1)
        return torch.where(places, self._images.to(hidden.dtype), hidden)
