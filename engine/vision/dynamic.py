"""The image encoder of a dynamic-resolution model (Qwen2.5-VL): each image resized to its planned
grid of merged patches (engine/vision/grids.py), preprocessed by the model's own processor, and
run through the tower at that grid: a warmed image bucket of one image, whose size key is its
grid's (engine/vision/grids.py, `grid_key`); and each prompt's M-RoPE positions."""

from __future__ import annotations

import io
import time

import torch

from engine.batch import ImageInput, Request
from engine.buckets.images import ImageBucket, ImageLimits
from engine.errors import InvalidRequestError
from engine.vision.encoder import ImageEncoder, images_of, to_host
from engine.vision.grids import fit_to_grid, grid_key, key_grid, plan_grids, rope_index


class DynamicResolutionEncoder(ImageEncoder):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._towers: dict[tuple[int, int], tuple] = {}  # grid -> (run, metadata on the device)

    def _image_limits(self, max_images: int) -> ImageLimits:
        """Its tower runs one image at a time, at each of the planned grids (`grids`)."""
        return ImageLimits(1, tuple(grid_key(grid) for grid in self.grids))

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
            if self.recorder is not None:
                self.recorder.image(1, grid_key(grid))
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
        run, layout = self._tower_at(grid)
        return self.adapter.run(self._shape(grid), run, self.adapter.to_device(pixels), *layout)

    def _tower_at(self, grid: tuple[int, int]) -> tuple:
        """(the tower's run at the grid, its metadata on the device): built on the host from the
        grid and copied once, so the device reads nothing back to learn the image's layout."""
        found = self._towers.get(grid)
        if found is None:
            run, layout = self.model.tower_at(self._thw(grid))
            found = self._towers[grid] = (run, tuple(self.adapter.to_device(t) for t in layout))
        return found

    def _thw(self, grid: tuple[int, int]) -> tuple[int, int, int]:
        """The tower's grid (t, h, w), in patches."""
        merge = self.spec.factor // self.spec.patch_size
        return 1, grid[0] * merge, grid[1] * merge

    def _shape(self, grid: tuple[int, int]) -> tuple:
        return ("vision", *grid)

    def shape(self, bucket: ImageBucket) -> tuple:
        return self._shape(key_grid(bucket.size))

    def _dummy(self, bucket: ImageBucket) -> tuple:
        """(the tower's run at the bucket's grid, zero pixels and its metadata on the device)."""
        grid = key_grid(bucket.size)
        merge = self.spec.factor // self.spec.patch_size
        patches = grid[0] * grid[1] * merge * merge
        run, layout = self._tower_at(grid)
        pixels = self.adapter.to_device(torch.zeros((patches, self.model.patch_width)))
        return run, (pixels, *layout)

    def warm_bucket(self, bucket: ImageBucket, graph: bool = True) -> None:
        run, inputs = self._dummy(bucket)
        self.adapter.warm(self.shape(bucket), run, *inputs, graph=graph)

    def replay(self, bucket: ImageBucket) -> None:
        run, inputs = self._dummy(bucket)
        self.adapter.run(self.shape(bucket), run, *inputs)
