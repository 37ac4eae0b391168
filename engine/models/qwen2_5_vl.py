"""Qwen2.5-VL: transformers' own vision tower and patch merger (replicated on every rank) beside our
native Qwen2 decoder with multimodal rope (M-RoPE, engine/layers/mrope.py). An image runs through
the tower at the grid its processor picks (engine/vision/grids.py) and its features take the
places of its image tokens in the prompt's embeddings.

Inputs past the text model's (after the LoRA index, where adapters are loaded): in a prefill, the
image embeddings [rows, width, hidden] and the M-RoPE positions [3, rows, width]; in a decode,
each row's position delta [rows] (the rope turns at position + delta on all three rows), so every
bucket keeps its one static shape.

The tower runs on metadata built on the host from the image's grid (`tower_layout`): transformers'
own forward derives its rotary positions, window order and attention spans from `grid_thw` on the
device (`.tolist()`, `unique_consecutive`, a split by tensor lengths), each a graph break. Here they
are index tensors, and the spans become each patch's span number, so one graph serves every grid
of a planned token count: the image's patches padded to that count (engine/vision/grids.py), the
padding a span of its own, which the image never attends to."""

from __future__ import annotations

import functools
from typing import NamedTuple

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
        self._tower_runs: dict[tuple, tuple] = {}
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

    def tower_run(self, tokens: int):
        """The tower's run at a bucket of `tokens` merged patches: made once per bucket, so a
        device keying graphs by the callable sees one a bucket."""
        found = self._tower_runs.get(tokens)
        if found is None:
            found = self._tower_runs[tokens] = functools.partial(self._tower_forward)
        return found

    @torch.inference_mode()
    def _tower_forward(
        self, pixels, position_ids, window_index, reverse_index, full_spans, window_spans
    ):
        """transformers' Qwen2_5_VisionTransformerPretrainedModel.forward on host-built metadata
        (TowerLayout): each patch attends to the patches of its own span only."""
        visual = self.visual
        hidden = visual.patch_embed(pixels.to(visual.patch_embed.proj.weight.dtype))
        patches = hidden.shape[0]
        hidden = visual.permute_input_for_window_attn(hidden, window_index, seq_len=patches)
        rope = visual.rotary_pos_emb(hidden, position_ids)
        rope = tuple(
            visual.permute_input_for_window_attn(f, window_index, seq_len=patches) for f in rope
        )
        full, windows = (span_mask(spans, hidden.dtype) for spans in (full_spans, window_spans))
        for number, block in enumerate(visual.blocks):
            mask = full if number in visual.fullatt_block_indexes else windows
            hidden = hidden + span_attention(block.attn, block.norm1(hidden), rope, mask)
            hidden = hidden + block.mlp(block.norm2(hidden))
        return visual.merger(hidden)[reverse_index, :]

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


class TowerLayout(NamedTuple):
    """The tower's metadata for one image padded to a bucket, built on the host (its graph's
    tensor inputs); patches are in window order from `window_index` on."""

    position_ids: torch.Tensor  # [patches, 2] each patch's (row, column), merge-block major
    window_index: torch.Tensor  # [tokens] the merged patches in window order
    reverse_index: torch.Tensor  # [tokens] window order back to the grid's
    full_spans: torch.Tensor  # [patches] the full attention's span of each patch
    window_spans: torch.Tensor  # [patches] the windowed attention's span of each patch


def tower_layout(visual, thw: tuple[int, int, int], tokens: int) -> TowerLayout:
    """The TowerLayout of one image at `thw` (t, h, w in patches) padded to `tokens` merged
    patches, by transformers' own vision_utils on a host grid_thw: the padding comes after the
    image in both orders and is one span of its own in both attentions."""
    from transformers.vision_utils import get_vision_position_ids, get_vision_window_index

    grid_thw = torch.tensor([thw])
    unit = visual.spatial_merge_size**2
    real = thw[0] * thw[1] * thw[2] // unit
    position_ids = get_vision_position_ids(grid_thw, visual.spatial_merge_size)
    window_index, cu_windows = get_vision_window_index(
        grid_thw,
        spatial_merge_size=visual.spatial_merge_size,
        window_size=visual.window_size,
        patch_size=visual.patch_size,
    )
    padding = tokens - real
    window_index = torch.cat([window_index, torch.arange(real, tokens)])
    lengths = (cu_windows[1:] - cu_windows[:-1]).long()  # in patches
    pad = torch.full((padding * unit,), -1, dtype=torch.long)  # the padding's span in both
    return TowerLayout(
        position_ids=torch.cat([position_ids, position_ids.new_zeros((padding * unit, 2))]),
        window_index=window_index,
        reverse_index=torch.argsort(window_index),
        full_spans=torch.cat([torch.zeros(real * unit, dtype=torch.long), pad]),
        window_spans=torch.cat([torch.arange(len(lengths)).repeat_interleave(lengths), pad]),
    )


def span_mask(spans: torch.Tensor, dtype) -> torch.Tensor:
    """[1, 1, patches, patches] the additive mask that keeps each patch to its own span."""
    same = spans.unsqueeze(0) == spans.unsqueeze(1)
    blocked = torch.full((), torch.finfo(dtype).min, dtype=dtype, device=spans.device)
    return torch.where(same, torch.zeros((), dtype=dtype, device=spans.device), blocked)[None, None]


def span_attention(attn, hidden: torch.Tensor, rope: tuple, mask: torch.Tensor):
    """transformers' Qwen2_5_VLVisionAttention.forward (its path without flash attention) over
    the whole run at once, each patch kept to its own span by `mask` (span_mask)."""
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
        ALL_ATTENTION_FUNCTIONS,
        apply_rotary_pos_emb_vision,
        eager_attention_forward,
    )

    rows = hidden.shape[0]
    query, key, value = (
        attn.qkv(hidden).reshape(rows, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
    )
    query, key = apply_rotary_pos_emb_vision(query, key, *rope)
    query, key, value = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))
    implementation = attn.config._attn_implementation
    if "flash" in (implementation or ""):
        implementation = "sdpa"  # flash attention would need the spans as lengths
    interface = ALL_ATTENTION_FUNCTIONS.get_interface(implementation, eager_attention_forward)
    out = interface(
        attn,
        query,
        key,
        value,
        attention_mask=mask,
        scaling=attn.scaling,
        dropout=0.0,
        is_causal=False,
    )[0]
    return attn.proj(out.reshape(rows, -1).contiguous())
