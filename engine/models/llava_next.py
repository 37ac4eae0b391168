"""LLaVA-NeXT (LLaVA 1.6): LLaVA's tower and decoder, an image seen at any resolution as tiles.
The processor resizes the image to the best of the config's grid resolutions and cuts it into
tower-sized tiles, plus a base tile of the whole image; the tower runs on tiles (so its image
buckets count tiles); each image's tile features are then packed as transformers packs them:
the base tile's, then the grid's with its padding cut away and a learned row end per row."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from engine.distributed import SINGLE, Parallel
from engine.models.config import ModelConfig
from engine.models.llava import LlavaForConditionalGeneration, to_host


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    hf_config_class = "LlavaNextConfig"

    def __init__(
        self,
        config: ModelConfig,
        max_positions: int,
        parallel: Parallel = SINGLE,
        moe_impl: str = "dense",
    ):
        super().__init__(config, max_positions, parallel, moe_impl)
        self.row_end = torch.nn.Module()  # holds the checkpoint's top-level `image_newline`
        self.row_end.image_newline = torch.nn.Parameter(torch.zeros(config.hidden_size))

    def checkpoint_target(self, name: str) -> tuple[str, str, object]:
        if name == "image_newline":
            return "row_end", name, None
        return super().checkpoint_target(name)

    def _projector(self, hf):
        from transformers.models.llava_next.modeling_llava_next import (
            LlavaNextMultiModalProjector,
        )

        return LlavaNextMultiModalProjector(hf)

    @torch.inference_mode()
    def pack_images(self, tiles: list[torch.Tensor], sizes: list[tuple[int, int]]) -> list:
        """Each image's [tokens, hidden] from its tiles' [tiles, tokens per tile, hidden] and its
        (height, width): transformers' LlavaNextModel.pack_image_features itself."""
        from transformers.models.llava_next.modeling_llava_next import LlavaNextModel

        owner = SimpleNamespace(config=self.hf_config)
        packed, _ = LlavaNextModel.pack_image_features(
            owner,
            list(tiles),
            torch.tensor(sizes),
            vision_feature_select_strategy=self.select,
            image_newline=to_host(self.row_end.image_newline).to(tiles[0].dtype),
        )
        return packed
