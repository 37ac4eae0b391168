"""The image encoder of a dynamic-resolution model (Qwen2.5-VL): each image resized to its planned
grid of merged patches (engine/vision/grids.py), preprocessed by the model's own processor, and
run through the tower at that grid, a warmed bucket shape; and each prompt's M-RoPE positions."""

from __future__ import annotations

import io
import time

import torch

from engine.batch import ImageInput, Request
from engine.errors import InvalidRequestError
from engine.vision.encoder import ImageEncoder, images_of, to_host
from engine.vision.grids import fit_to_grid, plan_grids, rope_index


class DynamicResolutionEncoder(ImageEncoder):
    def _image_limits(self, max_images: int) -> None:
        """Its tower runs one image at a time at planned grids (`grids`), warmed by warm()."""
        return None

    @property
    def grids(self) -> tuple[tuple[int, int], ...]:
        spec = self.spec
        return plan_grids(spec.factor, spec.min_pixels, spec.max_pixels)

    def rope_index(self, request: Request, ids: list[int]) -> tuple[torch.Tensor, int]:
        """The prompt's [3, tokens] M-RoPE positions and the delta of the positions after it."""
        grids = [self.spec.grid(i.width, i.height) for i in images_of(request)]
        return rope_index(ids, self.spec.image_token_id, grids)

    def _encode(self, request_id: int, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's [tokens, hidden], one tower run per image at its planned grid."""
        start = time.perf_counter_ns()
        features = []
        for image in images:
            pixels, grid = self._patches(request_id, image)
            features.append(to_host(self._run_tower(pixels, grid)))  # joined on the host
        self.adapter.synchronize()
        self.stats["images_encoded"] += len(images)
        self.stats["encoder_ns"] += time.perf_counter_ns() - start
        return features

    def _patches(self, request_id: int, image: ImageInput) -> tuple[torch.Tensor, tuple]:
        """[patches, channels * temporal * patch * patch] of the image at its planned grid."""
        from PIL import Image

        try:
            decoded = Image.open(io.BytesIO(image.data)).convert("RGB")
        except Exception as error:  # noqa: BLE001 - Pillow raises several kinds for a bad file
            raise InvalidRequestError(
                f"request {request_id}: an image is unreadable: {error}"
            ) from None
        grid = self.spec.grid(image.width, image.height)
        fitted = fit_to_grid(decoded, self.spec, self.processor.resample)
        out = self.processor(images=[fitted], return_tensors="pt")
        merge = self.spec.factor // self.spec.patch_size
        if out["image_grid_thw"][0].tolist() != [1, grid[0] * merge, grid[1] * merge]:
            raise InvalidRequestError(  # the processor's settings differ from the planned grids
                f"request {request_id}: the processor's grid {out['image_grid_thw'][0].tolist()} "
                f"is not the planned {grid}"
            )
        return out["pixel_values"], grid

    def _run_tower(self, pixels: torch.Tensor, grid: tuple[int, int]) -> torch.Tensor:
        pixels = pixels.to(self.adapter.torch_device)
        return self.adapter.run(
            self.shape(grid), self.model.image_features, pixels, self._thw(grid)
        )

    def _thw(self, grid: tuple[int, int]) -> torch.Tensor:
        """The tower's grid_thw, in patches (the tower reads it on the host)."""
        merge = self.spec.factor // self.spec.patch_size
        return torch.tensor([[1, grid[0] * merge, grid[1] * merge]])

    def shape(self, grid: tuple[int, int]) -> tuple:
        return ("vision", *grid)

    def warm(self) -> None:
        merge = self.spec.factor // self.spec.patch_size
        width = self.model.patch_width
        for grid in self.grids:
            patches = grid[0] * grid[1] * merge * merge
            pixels = torch.zeros((patches, width), device=self.adapter.torch_device)
            self.adapter.warm(self.shape(grid), self.model.image_features, pixels, self._thw(grid))
