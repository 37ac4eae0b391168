"""A vision-language model's images on the shard: each prompt's text with its images expanded to
image tokens (as the router counts it, engine/vision/spec.py), the images preprocessed by the
model's own transformers image processor, and the tower run at planned image-batch buckets
(1, 2, 4, ... images), warmed with the language model's buckets. Features are kept by the
image's content hash, so an image sent again (the next turn of a chat, `n` > 1) is not encoded
again."""

from __future__ import annotations

import hashlib
import io
import time
from collections import OrderedDict
from dataclasses import replace

import torch

from engine.batch import ImageInput, Request
from engine.errors import InvalidRequestError
from engine.vision.keys import image_spans, keyed_ids
from engine.vision.spec import ImageSpec

CACHED_IMAGES = 64  # features of this many recent images are kept


def images_of(request: Request) -> list[ImageInput]:
    return [c for c in request.chunks if not isinstance(c, str)]


def sized(request_id: int, chunk):
    """An image with its width and height (the wire carries only its bytes): Pillow reads them
    from the file's header; text as it is."""
    if isinstance(chunk, str) or chunk.width:
        return chunk
    from PIL import Image

    try:
        with Image.open(io.BytesIO(chunk.data)) as image:
            width, height = image.size
    except Exception as error:  # noqa: BLE001 - Pillow raises several kinds for a bad file
        raise InvalidRequestError(
            f"request {request_id}: an image is unreadable: {error}"
        ) from None
    return replace(chunk, width=width, height=height)


def image_buckets(max_images: int) -> tuple[int, ...]:
    """Image-batch sizes the tower runs at: powers of two up to max_images, and max_images."""
    sizes, size = [], 1
    while size < max_images:
        sizes.append(size)
        size *= 2
    return tuple(sizes + [max_images])


class ImageEncoder:
    def __init__(self, model, model_dir, tokenizer, spec: ImageSpec, adapter, max_images: int = 8):
        from transformers import AutoImageProcessor

        try:
            self.processor = AutoImageProcessor.from_pretrained(model_dir)
        except (OSError, ValueError) as error:
            raise InvalidRequestError(f"cannot load the model's image processor: {error}") from None
        if getattr(self.processor, "do_pan_and_scan", False):  # crops: more images an image
            raise InvalidRequestError(
                "the image processor's do_pan_and_scan is not served: set it to false in the "
                "model's processor config"
            )
        self.model, self.tokenizer, self.spec, self.adapter = model, tokenizer, spec, adapter
        self.token_text = tokenizer.convert_ids_to_tokens(spec.image_token_id)
        self.around = spec.around(tokenizer)  # Gemma 3's begin and end of image
        self.buckets = image_buckets(max_images)
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.stats = {"images_encoded": 0, "encoder_ns": 0, "image_cache_hits": 0}

    # --- the prompt ------------------------------------------------------------------------------

    def prompt_text(self, request: Request) -> str:
        """The prompt with each image as its image tokens (the router tokenizes the same text)."""
        return "".join(
            chunk if isinstance(chunk, str) else self.placeholder(chunk) for chunk in request.chunks
        )

    def placeholder(self, image: ImageInput) -> str:
        return self.spec.placeholder(self.token_text, image.width, image.height, self.around)

    def check_whole(self, request: Request, most: int) -> None:
        """A model whose image tokens attend both ways computes each image in one forward: an
        image of more tokens than one forward holds (`most`) is refused, never cut."""
        if not self.spec.bidirectional:
            return
        for count in self.counts(request):
            if count > most:
                raise InvalidRequestError(
                    f"request {request.id}: an image of {count} tokens does not fit one prefill "
                    f"chunk of at most {most} tokens (its tokens attend to each other both ways)"
                )

    def prompt_ids(self, request: Request) -> list[int]:
        request.chunks = [sized(request.id, c) for c in request.chunks]
        ids = self.tokenizer(
            self.prompt_text(request), add_special_tokens=request.add_special_tokens
        )["input_ids"]
        if request.truncate and len(ids) > request.truncate:
            raise InvalidRequestError(
                f"request {request.id}: truncate={request.truncate} would cut the prompt's images"
            )
        expected = sum(
            self.spec.tokens(c.width, c.height) for c in request.chunks if not isinstance(c, str)
        )
        if ids.count(self.spec.image_token_id) != expected:
            raise InvalidRequestError(
                f"request {request.id}: the prompt's text holds the image token itself"
            )
        return ids

    def spans(self, request: Request, ids: list[int]) -> list[tuple[int, int]]:
        """Each image's [first, last) positions in the prompt's ids."""
        return image_spans(ids, self.spec.image_token_id, self.counts(request))

    def counts(self, request: Request) -> list[int]:
        """The tokens of each of the prompt's images, in order."""
        return [self.spec.tokens(c.width, c.height) for c in images_of(request)]

    def keyed(self, request: Request, ids: list[int]) -> list[int]:
        """The ids its KV blocks are hashed over: each image token keyed by its image's content
        (engine/vision/keys.py), so that a block holding one image never serves another."""
        images = images_of(request)
        counts = self.counts(request)
        return keyed_ids(
            ids, self.spec.image_token_id, [(i.data, n) for i, n in zip(images, counts)]
        )

    # --- the images ------------------------------------------------------------------------------

    def encode(self, request: Request, ids: list[int]) -> torch.Tensor:
        """[image tokens of the prompt, hidden]: every image's features, in prompt order. An image
        whose tokens all lie in the prefix the router found cached (cache_len) is not encoded:
        its KV is there already, and its features (zeros here) are read nowhere."""
        images, counts = images_of(request), self.counts(request)
        spans = self.spans(request, ids)
        keys = [hashlib.sha256(image.data).hexdigest() for image in images]
        cached = [last <= request.cache_len for _, last in spans]
        missing = {}
        for key, image, in_kv in zip(keys, images, cached):
            if in_kv or key in self.cache:
                self.stats["image_cache_hits"] += 1
                if key in self.cache:
                    self.cache.move_to_end(key)
            elif key not in missing:
                missing[key] = image
        if missing:
            features = self._encode(request.id, list(missing.values()))
            for key, feature in zip(missing, features):
                self.cache[key] = feature
        hidden = self.model.config.hidden_size
        found = [
            torch.zeros((count, hidden)) if in_kv else self.cache[key]
            for key, count, in_kv in zip(keys, counts, cached)
        ]
        while len(self.cache) > CACHED_IMAGES:
            self.cache.popitem(last=False)
        return torch.cat([f.float() for f in found])

    def _encode(self, request_id: int, images: list[ImageInput]) -> list[torch.Tensor]:
        """Each image's [tokens, hidden]: its tiles through the tower, then packed."""
        start = time.perf_counter_ns()
        tiles, counts = self._pixels(request_id, images)
        features = self._run_tower(tiles)
        grouped, first = [], 0
        for count in counts:
            grouped.append(torch.stack(features[first : first + count]))
            first += count
        packed = self.model.pack_images(grouped, [(i.height, i.width) for i in images])
        self.stats["images_encoded"] += len(images)
        self.stats["encoder_ns"] += time.perf_counter_ns() - start
        return packed

    def _pixels(self, request_id: int, images: list[ImageInput]) -> tuple[torch.Tensor, list]:
        """The tower's tiles of every image, and how many each image has."""
        from PIL import Image

        try:
            decoded = [Image.open(io.BytesIO(image.data)).convert("RGB") for image in images]
        except Exception as error:  # noqa: BLE001 - Pillow raises several kinds for a bad file
            raise InvalidRequestError(
                f"request {request_id}: an image is unreadable: {error}"
            ) from None
        pixels = self.processor(images=decoded, return_tensors="pt")["pixel_values"]
        if pixels.dim() == 4:  # one tile an image (LLaVA)
            return pixels, [1] * len(images)
        counts = [self.spec.tiles(i.width, i.height) for i in images]  # the rest is padding
        return torch.cat([p[:n] for p, n in zip(pixels, counts)]), counts

    def _run_tower(self, pixels: torch.Tensor) -> list[torch.Tensor]:
        """Each tile's features; the tower runs at bucket shapes (padding tiles are zeros)."""
        out, largest = [], self.buckets[-1]
        for first in range(0, len(pixels), largest):
            part = pixels[first : first + largest]
            bucket = next(b for b in self.buckets if b >= len(part))
            padded = torch.zeros((bucket, *part.shape[1:]), dtype=part.dtype)
            padded[: len(part)] = part
            padded = padded.to(self.adapter.torch_device)
            features = self.adapter.run(self.shape(bucket), self.model.image_features, padded)
            out += list(features[: len(part)])
        self.adapter.synchronize()
        return out

    def shape(self, bucket: int) -> tuple:
        return ("vision", bucket, self.spec.image_size)

    def warm(self) -> None:
        size = self.spec.image_size
        for bucket in self.buckets:
            pixels = torch.zeros((bucket, 3, size, size), device=self.adapter.torch_device)
            self.adapter.warm(self.shape(bucket), self.model.image_features, pixels)
