"""What a vision-language model's config says about its images: the family, the image token, and
how many positions one image takes in the prompt. The router counts a prompt's tokens with it and
the shard expands each image into the same tokens, so both agree on every length."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

SERVED = ("llava",)
# Families with a vision config that are not served yet, named so the refusal can say so.
KNOWN = {
    "llava_next": "LLaVA-NeXT",
    "qwen2_5_vl": "Qwen2.5-VL",
    "qwen2_vl": "Qwen2-VL",
    "gemma3": "Gemma 3",
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
    tokens_per_image: int
    image_size: int  # the tower's square input, in pixels

    def tokens(self, width: int, height: int) -> int:
        """Positions one image takes (LLaVA: fixed, the processor resizes every image)."""
        return self.tokens_per_image

    def placeholder(self, token_text: str, width: int, height: int) -> str:
        """The prompt text of one image: its image token, once per position."""
        return token_text * self.tokens(width, height)


def image_spec(config: dict) -> ImageSpec | None:
    """The spec of a config.json (as a dict); None for a text-only model. A vision model of a
    family not served raises UnsupportedVisionModel naming it."""
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
    return _llava(config, vision)


def _llava(config: dict, vision: dict) -> ImageSpec:
    size, patch = vision.get("image_size", 224), vision.get("patch_size", 14)
    tokens = (size // patch) ** 2 + 1  # the patches and the class token
    if config.get("vision_feature_select_strategy", "default") == "default":
        tokens -= 1  # the class token is dropped
    token = config.get("image_token_id", config.get("image_token_index", 32000))
    return ImageSpec("llava", token, tokens, size)


def spec_of_dir(path: str | Path) -> ImageSpec | None:
    """The spec of the model in directory `path` (no config.json: a text model)."""
    config = Path(path) / "config.json"
    if not config.is_file():
        return None
    return image_spec(json.loads(config.read_text()))
