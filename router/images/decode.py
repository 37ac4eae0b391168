"""An image's bytes checked with Pillow: a format we serve, within the pixel limit, not corrupt."""

from __future__ import annotations

import base64
import binascii
import io
import re
from dataclasses import dataclass

from engine.batch import ImageInput

# Pillow format name -> the MIME type the chunk carries
FORMATS = {"PNG": "image/png", "JPEG": "image/jpeg", "WEBP": "image/webp", "GIF": "image/gif"}
DEFAULT_MAX_PIXELS = 4096 * 4096
DEFAULT_MAX_IMAGES = 8
DEFAULT_MAX_BYTES = 20 * 1024 * 1024
DATA_URL = re.compile(r"data:(?P<mime>[\w.+-]+/[\w.+-]+)?(?P<b64>;base64)?,(?P<data>.*)", re.S)


class ImageError(ValueError):
    """The image is unusable: the request's fault (HTTP 422 naming the problem)."""


@dataclass(frozen=True)
class ImageLimits:
    max_pixels: int = DEFAULT_MAX_PIXELS
    max_images: int = DEFAULT_MAX_IMAGES  # per request
    max_bytes: int = DEFAULT_MAX_BYTES  # of one image, encoded
    allow_urls: bool = False  # http(s) URLs (else data: URLs only)
    url_timeout: float = 10.0  # seconds for one URL, redirects included


def data_url_bytes(url: str, limits: ImageLimits) -> bytes:
    """The bytes of a `data:` URL (base64, as browsers and the OpenAI clients write them)."""
    match = DATA_URL.fullmatch(url.strip())
    if match is None or not match["b64"]:
        raise ImageError("an image data URL must read data:<type>;base64,<data>")
    if len(match["data"]) > limits.max_bytes * 4 // 3 + 4:
        raise ImageError(f"an image is larger than {limits.max_bytes} bytes")
    try:
        return base64.b64decode(match["data"], validate=True)
    except (binascii.Error, ValueError):
        raise ImageError("an image data URL's base64 data is corrupt") from None


def checked(data: bytes, limits: ImageLimits) -> ImageInput:
    """The image if Pillow reads it whole, in a served format, within the pixel limit."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ImageError(f"an image is larger than {limits.max_bytes} bytes")
    try:
        with Image.open(io.BytesIO(data)) as image:
            kind, (width, height) = image.format, image.size
            if kind not in FORMATS:
                raise ImageError(
                    f"image format {kind} is not supported (supported: {', '.join(FORMATS)})"
                )
            if width * height > limits.max_pixels:
                raise ImageError(
                    f"an image has {width}x{height} = {width * height} pixels, more than the "
                    f"limit of {limits.max_pixels}"
                )
            image.load()  # decodes the whole image: a truncated or corrupt one fails here
    except UnidentifiedImageError:
        raise ImageError("an image is corrupt or of an unknown format") from None
    except (OSError, SyntaxError, ValueError) as error:
        if isinstance(error, ImageError):
            raise
        raise ImageError(f"an image is corrupt: {error}") from None
    except Image.DecompressionBombError:
        raise ImageError(
            f"an image has more pixels than the limit of {limits.max_pixels}"
        ) from None
    return ImageInput(data, FORMATS[kind], width, height)
