"""A prompt's images: TGI's markdown `![alt](url)` found in the text, each read and checked, and
the prompt as the shard gets it (text and image chunks) and as the router counts it (each image
its model's image tokens)."""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass, field

from engine.batch import ImageInput
from engine.vision.keys import keyed_ids
from engine.vision.spec import ImageSpec
from router.images.decode import ImageError, ImageLimits, checked, data_url_bytes
from router.images.fetch import fetch_image, public_address

MARKDOWN_IMAGE = re.compile(r"!\[[^\]\n]*\]\((?P<url>(?:data:|https?://)[^)\s]+)\)")


@dataclass
class ImagePolicy:
    """The model's images (spec None: a text-only model) and what a request may send."""

    spec: ImageSpec | None
    token_text: str = ""  # the image token as text (the tokenizer's)
    limits: ImageLimits = field(default_factory=ImageLimits)
    allowed: object = public_address  # (address, port) -> bool, for URL fetches
    around: tuple[str, str] = ("", "")  # the texts around an image's tokens (ImageSpec.around)


@dataclass
class ImagePrompt:
    chunks: list[str | ImageInput]
    counted: str  # the text the router tokenizes: every image as its image tokens
    wire: str  # TGI's `inputs`: every image inlined as a markdown data URL


def has_images(text: str) -> bool:
    return MARKDOWN_IMAGE.search(text) is not None


def image_prompt(text: str, policy: ImagePolicy) -> ImagePrompt | None:
    """The prompt's images read and checked; None where it has none (or the model takes none:
    a text model reads markdown as text, as TGI's do)."""
    if policy.spec is None or not has_images(text):
        return None
    matches = list(MARKDOWN_IMAGE.finditer(text))
    if len(matches) > policy.limits.max_images:
        raise ImageError(
            f"a request may hold up to {policy.limits.max_images} images. Given: {len(matches)}"
        )
    chunks: list[str | ImageInput] = []
    counted, wire, start = [], [], 0
    for match in matches:
        before = text[start : match.start()]
        image = read_image(match["url"], policy)
        if before:
            chunks.append(before)
        chunks.append(image)
        counted += [
            before,
            policy.spec.placeholder(policy.token_text, image.width, image.height, policy.around),
        ]
        wire += [before, markdown(image)]
        start = match.end()
    if text[start:]:
        chunks.append(text[start:])
    return ImagePrompt(chunks, "".join(counted) + text[start:], "".join(wire) + text[start:])


def keyed_prompt_ids(ids: list[int], chunks: list, policy: ImagePolicy) -> list[int]:
    """The prompt's ids for the prefix cache: each image token keyed by its image's content hash
    (engine/vision/keys.py), so a repeated image finds its KV and a different image never does."""
    spec = policy.spec
    images = [(c.data, spec.tokens(c.width, c.height)) for c in chunks if not isinstance(c, str)]
    return keyed_ids(ids, spec.image_token_id, images)


def read_image(url: str, policy: ImagePolicy) -> ImageInput:
    limits = policy.limits
    if url.startswith("data:"):
        return checked(data_url_bytes(url, limits), limits)
    if not limits.allow_urls:
        raise ImageError(
            "image URLs are not allowed (the router runs without --allow-image-urls): "
            "send the image as a data: URL"
        )
    return checked(fetch_image(url, limits, policy.allowed), limits)


def markdown(image: ImageInput) -> str:
    encoded = base64.b64encode(image.data).decode("ascii")
    return f"![](data:{image.mimetype};base64,{encoded})"


def policy_for(model_dir, tokenizer, limits: ImageLimits) -> ImagePolicy:
    """The image policy of the model in `model_dir` (config.json; none: a text model)."""
    from engine.vision.spec import spec_of_dir

    spec = spec_of_dir(model_dir) if model_dir else None
    token_text = tokenizer.convert_ids_to_tokens(spec.image_token_id) if spec else ""
    around = spec.around(tokenizer) if spec else ("", "")
    return ImagePolicy(spec, token_text, limits, around=around)
