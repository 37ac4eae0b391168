"""Gemma 3 with images: transformers' own SigLIP tower and Gemma3MultiModalProjector (replicated on
every rank, as LLaVA's CLIP tower is) beside our native Gemma 3 text model (engine/models/gemma.py:
sliding layers, local rope, q/k norms). The tower takes one fixed size (896 pixels in the released
models); the projector pools its patches to `mm_tokens_per_image` (256) tokens, which take the
places of the image tokens in the prompt's (scaled) embeddings.

Unlike LLaVA's, an image's tokens attend to each other both ways in prefill (transformers'
token_type_ids mask: causal OR same image, and the sliding layers' window over that). Which image
each token belongs to is computed here from the prompt's ids, a tensor of the bucket's shape, and
carried to attention in the prefill metadata (engine/attention/prompt.py)."""

from __future__ import annotations

import torch

from engine.attention import PrefillMetadata
from engine.models.gemma import GemmaForCausalLM
from engine.models.llava import LlavaForConditionalGeneration


class Gemma3ForConditionalGeneration(LlavaForConditionalGeneration, GemmaForCausalLM):
    """LLaVA's handling of the tower, images and checkpoint names; Gemma's decoder and embeddings
    (the method order puts LLaVA's image embedding around Gemma's scaled one)."""

    hf_config_class = "Gemma3Config"

    def _projector(self, hf):
        from transformers.models.gemma3.modeling_gemma3 import Gemma3MultiModalProjector

        return Gemma3MultiModalProjector(hf)

    @torch.inference_mode()
    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, mm_tokens_per_image, hidden] for [images, 3, size, size] pixels, as
        transformers' Gemma3Model.get_image_features computes them."""
        weight = self.multi_modal_projector.mm_input_projection_weight
        out = self.vision_tower(pixel_values=pixel_values.to(weight.dtype), return_dict=True)
        return self.multi_modal_projector(out.last_hidden_state)

    def forward(self, input_ids, positions, meta, logits_indices, *extra) -> torch.Tensor:
        if isinstance(meta, PrefillMetadata):
            meta = meta._replace(image_groups=image_groups(input_ids, self.image_token_id))
        return super().forward(input_ids, positions, meta, logits_indices, *extra)


def image_groups(input_ids: torch.Tensor, image_token_id: int) -> torch.Tensor:
    """[rows, seq] the image each token belongs to (0, 1, ... in each row; -1 for text): a run of
    image tokens is one image (Gemma 3 puts its begin and end tokens between two images), as
    transformers' get_block_sequence_ids_for_mask counts them."""
    is_image = input_ids == image_token_id
    before = torch.nn.functional.pad(is_image, (1, 0), value=False)[:, :-1]
    starts = (is_image & ~before).long().cumsum(dim=1) - 1
    return torch.where(is_image, starts, torch.full_like(starts, -1))
