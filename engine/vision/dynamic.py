"""The image encoder of a dynamic-resolution model (Qwen2.5-VL): each image preprocessed by the
model's own processor at the grid of merged patches it picks (as transformers' own), and run
through the tower padded to the smallest planned token count that holds it: a warmed image bucket
of one image, whose size key is that count (engine/vision/grids.py); and each prompt's M-RoPE
positions."""

from __future__ import annotations

import io
import time

import torch

from engine.batch import ImageInput, Request
from engine.buckets.images import ImageBucket, ImageLimits
from engine.errors import InvalidRequestError, UnwarmedShapeError
from engine.models.llava import to_host
from engine.vision.encoder import ImageEncoder, images_of
from engine.vision.grids import rope_index, token_buckets


class DynamicResolutionEncoder(ImageEncoder):
    def _image_limits(self, max_images: int) -> ImageLimits:
        """Its tower runs one image at a time, at each of the planned token counts."""
        spec = self.spec
        return ImageLimits(1, token_buckets(spec.factor, spec.min_pixels, spec.max_pixels))

    def rope_index(self, request: Request, ids: list[int]) -> tuple[torch.Tensor, int]:
        """The prompt's [3, tokens] M-RoPE positions and the delta of the positions after it."""
        grids = [self.spec.grid(i.width, i.height) for i in images_of(request)]
        return rope_index(ids, self.spec.image_token_id, grids)

    def _encode(self, request_id: int, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's [tokens, hidden], one tower run per image, padded to its bucket."""
        start = time.perf_counter_ns()
        features = []
        for image in images:
            pixels, thw = self._patches(request_id, image)
            tokens = thw[0] * thw[1] * thw[2] // (self.spec.factor // self.spec.patch_size) ** 2
            if self.recorder is not None:
                self.recorder.image(1, tokens)
            bucket = self._bucket(request_id, image, tokens)
            out = self._run_tower(pixels, thw, bucket)
            features.append(to_host(out)[:tokens])  # joined on the host
        self.adapter.synchronize()
        self.stats["images_encoded"] += len(images)
        self.stats["encoder_ns"] += time.perf_counter_ns() - start
        return features

    def _patches(self, request_id: int, image: ImageInput) -> tuple[torch.Tensor, tuple]:
        """[patches, channels * temporal * patch * patch] of the image at the grid its processor
        picks, and that grid (t, h, w in patches)."""
        from PIL import Image

        try:
            decoded = Image.open(io.BytesIO(image.data)).convert("RGB")
        except Exception as error:  # noqa: BLE001 - Pillow raises several kinds for a bad file
            raise InvalidRequestError(
                f"request {request_id}: an image is unreadable: {error}"
            ) from None
        out = self.processor(images=[decoded], return_tensors="pt")
        thw = tuple(out["image_grid_thw"][0].tolist())
        rows, columns = self.spec.grid(image.width, image.height)
        merge = self.spec.factor // self.spec.patch_size
        if thw != (1, rows * merge, columns * merge):
            raise InvalidRequestError(  # the processor's settings differ from the config's
                f"request {request_id}: the processor's grid {list(thw)} is not the counted "
                f"{rows}x{columns} merged patches"
            )
        return out["pixel_values"], thw

    def _bucket(self, request_id: int, image: ImageInput, tokens: int) -> int:
        """The smallest warmed token count that holds the image's (strict: refused where none
        does; lenient: its own count)."""
        size = self.planned_size(tokens)
        if size is not None:
            return size
        if self.adapter.shapes.strict:
            warmed = ", ".join(str(b.size) for b in self.planned)
            raise UnwarmedShapeError(
                f"request {request_id}: an image of {image.width}x{image.height} pixels takes "
                f"{tokens} tokens, more than any warmed image bucket holds (tokens: {warmed})"
            )
        return tokens

    def _run_tower(self, pixels: torch.Tensor, thw: tuple, tokens: int) -> torch.Tensor:
        """The tower at a bucket of `tokens` merged patches; its metadata is built on the host
        and copied, so the device reads nothing back to learn the image's layout."""
        from engine.models.qwen2_5_vl import tower_layout

        layout = tower_layout(self.model.visual, thw, tokens)
        padded = torch.zeros((layout.full_spans.shape[0], pixels.shape[1]), dtype=pixels.dtype)
        padded[: len(pixels)] = pixels
        inputs = [self.adapter.to_device(t) for t in (padded, *layout)]
        return self.adapter.run(self._shape(tokens), self.model.tower_run(tokens), *inputs)

    def _shape(self, tokens: int) -> tuple:
        return ("vision", tokens)

    def shape(self, bucket: ImageBucket) -> tuple:
        return self._shape(bucket.size)

    def _dummy(self, bucket: ImageBucket) -> tuple:
        """(the tower's run at the bucket, zero pixels and metadata of its shapes)."""
        from engine.models.qwen2_5_vl import TowerLayout

        tokens = bucket.size
        patches = tokens * (self.spec.factor // self.spec.patch_size) ** 2
        layout = TowerLayout(
            position_ids=torch.zeros((patches, 2), dtype=torch.long),
            window_index=torch.arange(tokens),
            reverse_index=torch.arange(tokens),
            full_spans=torch.zeros(patches, dtype=torch.long),
            window_spans=torch.zeros(patches, dtype=torch.long),
        )
        pixels = torch.zeros((patches, self.model.patch_width))
        return self.model.tower_run(tokens), [self.adapter.to_device(t) for t in (pixels, *layout)]

    def warm_bucket(self, bucket: ImageBucket, graph: bool = True) -> None:
        run, inputs = self._dummy(bucket)
        self.adapter.warm(self.shape(bucket), run, *inputs, graph=graph)

    def replay(self, bucket: ImageBucket) -> None:
        run, inputs = self._dummy(bucket)
        self.adapter.run(self.shape(bucket), run, *inputs)
