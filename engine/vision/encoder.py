"""A vision-language model's images on the shard: each prompt's text with its images expanded to
image tokens (as the router counts it, engine/vision/spec.py), the images preprocessed by the
model's own transformers image processor, and the tower run at the plan's image buckets
(engine/buckets/images.py: `(count, size)` tower inputs), warmed with the language model's
buckets. Features are kept by the image's content hash, so an image sent again (the next turn of
a chat, `n` > 1) is not encoded again.

The image-shape interface: a model whose tower inputs are not the default (LLaVA's: the image's
tiles, `spec.tiles(width, height)`, each of the tower's `spec.image_size`) defines

- `image_shape_key(width, height) -> (count, size)`: the tower inputs one image becomes and their
  size key (a dynamic-resolution model: e.g. its patch grid's, bucketed like sequence lengths);
- `image_size_keys() -> tuple[int, ...]`: the size keys the plan warms (its processor resizes or
  pads an image to the smallest of them that holds it, `ImageEncoder.planned_size`).

Inputs of one size run together, split and padded along `count` (the first axis) to the
planned buckets; an image whose size no warmed bucket holds is refused in strict mode."""

from __future__ import annotations

import hashlib
import io
import time
from collections import OrderedDict
from dataclasses import replace

import torch

from engine.batch import ImageInput, Request
from engine.buckets.images import ImageBucket, ImageLimits, image_grid, split_run
from engine.errors import InvalidRequestError, UnwarmedShapeError
from engine.models.llava import to_host
from engine.vision.keys import image_spans, keyed_ids
from engine.vision.spec import ImageSpec

CACHED_IMAGES = 64  # features of this many recent images are kept
MAX_TOWER_INPUTS = 8  # the largest tower run, in inputs (images or tiles)


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


class ImageEncoder:
    def __init__(
        self, model, model_dir, tokenizer, spec: ImageSpec, adapter, max_images=MAX_TOWER_INPUTS
    ):
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
        self.limits = self._image_limits(max_images)
        # warmup sets the plan's
        self.planned: tuple[ImageBucket, ...] = image_grid(self.limits) if self.limits else ()
        self.recorder = None  # engine.buckets.shapes.ShapeRecorder of --record-shapes
        self.around = spec.around(tokenizer)  # the texts around an image's tokens
        self.cache: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.stats = {"images_encoded": 0, "encoder_ns": 0, "image_cache_hits": 0}

    # --- the image-shape interface (module doc) ---------------------------------------------------

    def _image_limits(self, max_images: int) -> ImageLimits | None:
        """The image buckets' limits (None: the encoder plans and warms its own shapes)."""
        return ImageLimits(max_images, self._size_keys())

    def _size_keys(self) -> tuple[int, ...]:
        own = getattr(self.model, "image_size_keys", None)
        return tuple(own()) if own is not None else (self.spec.image_size,)

    def shape_key(self, image: ImageInput) -> tuple[int, int]:
        """(tower inputs, size key) of one image: the model's own, else its tiles at the tower's
        resolution."""
        own = getattr(self.model, "image_shape_key", None)
        if own is not None:
            return tuple(own(image.width, image.height))
        return self.spec.tiles(image.width, image.height), self.spec.image_size

    def planned_size(self, size: int) -> int | None:
        """The smallest warmed size key that holds `size` (None: none does)."""
        return min((b.size for b in self.planned if b.size >= size), default=None)

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
        size = self._checked_size(request_id, images)
        tiles, counts = self._pixels(request_id, images)
        if self.recorder is not None:
            self.recorder.image(len(tiles), size)
        features = self._run_tower(tiles, size)
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

    def _checked_size(self, request_id: int, images: list[ImageInput]) -> int:
        """The one size key of the images' tower inputs. In strict mode an image whose size no
        warmed image bucket holds is refused here, naming it, before anything runs."""
        keys = [self.shape_key(image) for image in images]
        sizes = {size for _, size in keys}
        if len(sizes) > 1:
            raise InvalidRequestError(
                f"request {request_id}: images of tower sizes {sorted(sizes)} in one encode"
            )
        size = sizes.pop()
        if self.planned_size(size) is None and self.adapter.shapes.strict:
            image = images[0]
            warmed = ", ".join(f"[{b.count}, {b.size}]" for b in self.planned)
            raise UnwarmedShapeError(
                f"request {request_id}: an image of {image.width}x{image.height} pixels needs the "
                f"vision tower at size {size}, which no warmed image bucket holds (image "
                f"buckets [inputs, size]: {warmed})"
            )
        return size

    def _run_tower(self, pixels: torch.Tensor, size: int) -> list[torch.Tensor]:
        """Each input's features, on the host; the tower runs at the plan's image buckets
        (padding inputs are zeros), or, lenient, at the exact shape where none holds the size."""
        runs = split_run(self.planned, len(pixels), size) or [
            (len(pixels), ImageBucket(len(pixels), size))
        ]
        out, first = [], 0
        for count, bucket in runs:
            part = pixels[first : first + count]
            first += count
            padded = torch.zeros((bucket.count, *part.shape[1:]), dtype=part.dtype)
            padded[:count] = part
            features = self.adapter.run(
                self.shape(bucket), self._tower, self.adapter.to_device(padded)
            )
            out += list(to_host(features[:count]))
        self.adapter.synchronize()
        return out

    def _tower(self, pixels: torch.Tensor) -> torch.Tensor:
        """The tower's graph: features in float32, as the prompt's embeddings take them."""
        return self.model.image_features(pixels).float()

    def shape(self, bucket: ImageBucket) -> tuple:
        return ("vision", bucket.count, bucket.size)

    def dummy_input(self, bucket: ImageBucket) -> torch.Tensor:
        """Zero pixels of the bucket's shape: square tiles of its size."""
        return self.adapter.to_device(torch.zeros((bucket.count, 3, bucket.size, bucket.size)))

    def warm_bucket(self, bucket: ImageBucket, graph: bool = True) -> None:
        self.adapter.warm(self.shape(bucket), self._tower, self.dummy_input(bucket), graph=graph)

    def replay(self, bucket: ImageBucket) -> None:
        """One served run at `bucket` on zero pixels (`bucketserve check-shapes`)."""
        self.adapter.run(self.shape(bucket), self._tower, self.dummy_input(bucket))

    def warm(self) -> None:
        """Every planned image bucket (warmup warms them one by one, engine/warmup/warm.py)."""
        for bucket in self.planned:
            self.warm_bucket(bucket)
