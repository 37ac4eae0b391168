"""What a vision-language model's config says about its images: the family, the image token, and
how many positions one image takes in the prompt. The router counts a prompt's tokens with it and
the shard expands each image into the same tokens, so both agree on every length."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SERVED = ("llava", "llava_next", "qwen2_5_vl", "gemma3")
# Families with a vision config that are not served yet, named so the refusal can say so.
KNOWN = {
    "qwen2_5_vl": "Qwen2.5-VL",
    "qwen2_vl": "Qwen2-VL",
    "mllama": "mllama",
    "idefics2": "Idefics2",
    "idefics3": "Idefics3",
    "paligemma": "PaliGemma",
}


class UnsupportedVisionModel(ValueError):
    """A vision-language model of a family not served."""


@dataclass(frozen=True)
class ImageSpec:
    family: str
    image_token_id: int
    tokens_per_image: int  # LLaVA's; LLaVA-NeXT's base tile
    image_size: int  # the tower's square input (one tile), in pixels
    patch_size: int = 14
    grid_pinpoints: tuple = ()  # LLaVA-NeXT: the (height, width) resolutions an image is tiled at
    # Qwen2.5-VL (engine/vision/grids.py): pixels per merged patch side, the processor's limits
    factor: int = 0
    min_pixels: int = 0
    max_pixels: int = 0
    wrap: tuple[str, str] = ("", "")  # the text around an image's tokens (vision start and end)
    # Gemma 3: the tokens that open and close an image's tokens (its placeholder's ends)
    boi_token_id: int | None = None
    eoi_token_id: int | None = None

    @property
    def bidirectional(self) -> bool:
        """Whether an image's tokens attend to each other both ways in prefill (Gemma 3): then
        a prefill chunk must hold an image's tokens whole (engine/serving/chunks.py)."""
        return self.family == "gemma3"

    def tokens(self, width: int, height: int) -> int:
        """Positions one image takes. LLaVA: fixed (the processor resizes every image).
        LLaVA-NeXT: the base tile's, then the tiles' grid with its padding cut away and a row
        end per row, as transformers' LlavaNextProcessor counts them."""
        if self.family == "qwen2_5_vl":
            rows, columns = self.grid(width, height)
            return rows * columns
        if self.family != "llava_next":
            return self.tokens_per_image
        return self.tokens_per_image + _unpadded_grid_tokens(self, width, height)

    def grid(self, width: int, height: int) -> tuple[int, int]:
        """Qwen2.5-VL: the (rows, columns) of merged patches the image is served at: the one its
        processor resizes it to (`smart_resize`), as transformers serves it."""
        from engine.vision.grids import natural_grid

        return natural_grid(self, width, height)

    def tiles(self, width: int, height: int) -> int:
        """The tower's inputs for one image: 1 for LLaVA; the base tile and the grid's."""
        if self.family != "llava_next":
            return 1
        best_height, best_width = _best_resolution(self, width, height)
        return (best_height // self.image_size) * (best_width // self.image_size) + 1

    def placeholder(self, token_text: str, width: int, height: int, around=None) -> str:
        """The prompt text of one image: its image token, once per position, between the texts
        of `around` (self.around(tokenizer)), by default `wrap`."""
        before, after = self.wrap if around is None else around
        return before + token_text * self.tokens(width, height) + after

    def around(self, tokenizer) -> tuple[str, str]:
        """The texts around an image's tokens in its placeholder: `wrap`, or for Gemma 3 its
        processor's `full_image_sequence`, a blank line, the begin-of-image token, the image
        tokens, the end-of-image token and a blank line (Gemma3Processor replaces each image
        with it)."""
        if self.family != "gemma3":
            return self.wrap
        boi, eoi = tokenizer.convert_ids_to_tokens([self.boi_token_id, self.eoi_token_id])
        return f"\n\n{boi}", f"{eoi}\n\n"


def _best_resolution(spec: ImageSpec, width: int, height: int) -> tuple[int, int]:
    from transformers.image_processing_utils import select_best_resolution

    return select_best_resolution((height, width), [list(p) for p in spec.grid_pinpoints])


def _unpadded_grid_tokens(spec: ImageSpec, width: int, height: int) -> int:
    """transformers' LlavaNextProcessor._get_unpadded_features, and its row ends."""
    best_height, best_width = _best_resolution(spec, width, height)
    side = spec.image_size // spec.patch_size
    rows = side * (best_height // spec.image_size)
    columns = side * (best_width // spec.image_size)
    if width / height > columns / rows:
        new_height = int(round(height * (columns / width), 7))
        rows -= (rows - new_height) // 2 * 2
    else:
        new_width = int(round(width * (rows / height), 7))
        columns -= (columns - new_width) // 2 * 2
    return rows * columns + rows


def image_spec(config: dict, processor: dict | None = None) -> ImageSpec | None:
    """The spec of a config.json (as a dict; `processor`: its preprocessor_config.json, which
    holds Qwen2.5-VL's pixel limits); None for a text-only model. A vision model of a family not
    served raises UnsupportedVisionModel naming it."""
    vision = config.get("vision_config")
    if vision is None:
        return None
    kind = config.get("model_type", "")
    if kind not in SERVED:
        name = KNOWN.get(kind, kind or "unknown")
        raise UnsupportedVisionModel(
            f"vision-language model type {kind!r} ({name}) is not served: the served families "
            f"are {', '.join(SERVED)}"
        )
    if kind == "qwen2_5_vl":
        return _qwen2_5_vl(config, vision, processor or {})
    if kind == "gemma3":
        return _gemma3(config, vision)
    return _llava(kind, config, vision)


def _qwen2_5_vl(config: dict, vision: dict, processor: dict) -> ImageSpec:
    """Pixel limits as Qwen2VLImageProcessor reads them: min_pixels / max_pixels, else `size`."""
    size = processor.get("size") or {}
    patch = processor.get("patch_size", vision.get("patch_size", 14))
    merge = processor.get("merge_size", vision.get("spatial_merge_size", 2))
    return ImageSpec(
        "qwen2_5_vl",
        config.get("image_token_id", 151655),
        0,
        0,
        patch,
        factor=patch * merge,
        min_pixels=processor.get("min_pixels") or size.get("shortest_edge") or 56 * 56,
        max_pixels=processor.get("max_pixels") or size.get("longest_edge") or 28 * 28 * 1280,
        wrap=("<|vision_start|>", "<|vision_end|>"),
    )


def _gemma3(config: dict, vision: dict) -> ImageSpec:
    """A fixed-size SigLIP tower (896 pixels), its patches pooled to mm_tokens_per_image (256)."""
    return ImageSpec(
        "gemma3",
        config.get("image_token_index", config.get("image_token_id", 262_144)),
        config.get("mm_tokens_per_image", 256),
        vision.get("image_size", 896),
        vision.get("patch_size", 14),
        boi_token_id=config.get("boi_token_index", config.get("boi_token_id", 255_999)),
        eoi_token_id=config.get("eoi_token_index", config.get("eoi_token_id", 256_000)),
    )


def _llava(kind: str, config: dict, vision: dict) -> ImageSpec:
    size, patch = vision.get("image_size", 224), vision.get("patch_size", 14)
    tokens = (size // patch) ** 2 + 1  # the patches and the class token
    if config.get("vision_feature_select_strategy", "default") == "default":
        tokens -= 1  # the class token is dropped
    token = config.get("image_token_id", config.get("image_token_index", 32000))
    pinpoints = tuple(tuple(p) for p in config.get("image_grid_pinpoints") or ())
    if kind == "llava_next" and not pinpoints:
        raise UnsupportedVisionModel("a LLaVA-NeXT config needs image_grid_pinpoints")
    return ImageSpec(kind, token, tokens, size, patch, pinpoints)


def spec_of_dir(path: str | Path) -> ImageSpec | None:
    """The spec of the model in directory `path` (no config.json: a text model)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    return image_spec(json.loads(config.read_text()), processor_config(path))


def processor_config(path: str | Path) -> dict | None:
    """The model's preprocessor_config.json, None where it has none."""
    processor = Path(path) / "preprocessor_config.json"
    return json.loads(processor.read_text()) if processor.is_file() else None
