"""LLaVA: transformers' own CLIP tower and projector (replicated on every rank) beside our native
Llama-family language model. An image's features take the places of its image tokens in the
prompt's embeddings; everything after the embeddings is the text model's prefill."""

from __future__ import annotations

import torch

from engine.distributed import SINGLE, Parallel
from engine.models.config import ModelConfig
from engine.models.llama import LlamaForCausalLM


def to_host(tensor: torch.Tensor) -> torch.Tensor:
    """A fresh host tensor of a device tensor's values, so what runs on it afterwards (LLaVA-NeXT's
    packing, whose shapes follow each image's grid) is no device op and compiles no graph. Through
    numpy: on the simulator's CPU `.cpu()` hands back the device tensor itself, and numpy's copy is
    the host read that it is (numpy has no bfloat16: its bits travel as int16)."""
    host = tensor.detach().cpu()
    if host.dtype == torch.bfloat16:
        return torch.from_numpy(host.view(torch.int16).numpy().copy()).view(torch.bfloat16)
    return torch.from_numpy(host.numpy().copy())


class LlavaForConditionalGeneration(LlamaForCausalLM):
    takes_images = True  # the runner passes image embeddings to its prefills
    hf_config_class = "LlavaConfig"

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        parallel: Parallel = SINGLE,
        moe_impl: str = "dense",
    ):
        super().__init__(config, max_positions, parallel, moe_impl)
        import transformers
        from transformers import AutoModel

        hf = getattr(transformers, self.hf_config_class)(**config.vision)
        self.hf_config = hf
        self.image_token_id = hf.image_token_id
        self.feature_layer = getattr(hf, "vision_feature_layer", None)  # LLaVA's (not Gemma 3's)
        self.select = getattr(hf, "vision_feature_select_strategy", None)
        with torch.device("cpu"):  # its buffers are computed here, then kept through to_empty
            self.vision_tower = AutoModel.from_config(hf.vision_config)
            self.multi_modal_projector = self._projector(hf)
        persistent = set(self.vision_tower.state_dict())
        self._tower_buffers = {
            name: buffer.clone()
            for name, buffer in self.vision_tower.named_buffers()
            if name not in persistent
        }
        self._images: torch.Tensor | None = None

    def _projector(self, hf):
        from transformers.models.llava.modeling_llava import LlavaMultiModalProjector

        return LlavaMultiModalProjector(hf)

    def pack_images(self, tiles: list[torch.Tensor], sizes: list[tuple[int, int]]) -> list:
        """Each image's [tokens, hidden] from its tiles' features: LLaVA's one tile as it is."""
        return [t[0] for t in tiles]

    def rebuild_rotary(self, max_positions: int, device) -> None:
        super().rebuild_rotary(max_positions, device)
        for name, value in self._tower_buffers.items():  # to_empty left them uninitialized
            module, _, attr = name.rpartition(".")
            owner = self.vision_tower.get_submodule(module) if module else self.vision_tower
            getattr(owner, attr).copy_(value.to(device))

    def checkpoint_target(self, name: str) -> tuple[str, str, object]:
        """Checkpoints name the text model `language_model.model.*` (as transformers saves them),
        or `language_model.*` (model.language_model.*, the loader dropping `model.`)."""
        for prefix in ("language_model.model.", "language_model."):
            if name.startswith(prefix):
                return super().checkpoint_target(name.removeprefix(prefix))
        if name.startswith(("vision_tower.", "multi_modal_projector.")):  # transformers' modules
            # hub LLaVA checkpoints nest CLIP's weights one level deeper than transformers 5 does
            name = name.replace("vision_tower.vision_model.", "vision_tower.", 1)
            module, _, kind = name.rpartition(".")
            return module, kind, None
        return super().checkpoint_target(name)

    @torch.inference_mode()
    def image_features(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """[images, tokens per image, hidden] for [images, 3, size, size] pixels, as
        transformers' LlavaModel.get_image_features computes them."""
        out = self.vision_tower(
            pixel_values.to(self.multi_modal_projector.linear_1.weight.dtype),
            output_hidden_states=True,
            return_dict=True,
        )
        layers = [self.feature_layer] if isinstance(self.feature_layer, int) else self.feature_layer
        pool = [out.hidden_states[layer] for layer in layers]
        if self.select == "default":
            pool = [hidden[:, 1:] for hidden in pool]
        return self.multi_modal_projector(torch.cat(pool, dim=-1))

    def forward(self, input_ids, positions, meta, logits_indices, *extra) -> torch.Tensor:
        """`extra`: the LoRA index where adapters are loaded, then, in a prefill, the image
        embeddings [rows, width, hidden] (read only where input_ids hold the image token)."""
        lora_count = 1 if self.lora_set is not None else 0
        lora = extra[0] if lora_count else None
        self._images = extra[lora_count] if len(extra) > lora_count else None
        try:
            return super().forward(input_ids, positions, meta, logits_indices, lora)
        finally:
            self._images = None

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().embed(input_ids)
        if self._images is None:
            return hidden
        places = (input_ids == self.image_token_id).unsqueeze(-1)
        return torch.where(places, self._images.to(hidden.dtype), hidden)
