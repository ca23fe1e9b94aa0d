"""Images of vision pairs: the one decoding of stored image bytes that the build and every reader share."""

from __future__ import annotations

import hashlib
import io
import warnings
from typing import Any

DEFAULT_MAX_IMAGE_PIXELS = 1 << 25
"""The default --max-image-pixels (33,554,432: 8192 x 4096): an image declaring more is rejected as image_too_large."""
MAX_IMAGE_BYTES = 64 << 20
"""The largest image file read (64 MiB); a larger one is rejected as image_too_large before it is read."""
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
"""The only formats image bytes are decoded as (Pillow's format names), each by Pillow in-process: nothing else is
tried, so no plugin that runs an external program (EPS runs Ghostscript) is ever reached. Another format is an
image_unreadable reject naming these."""


class ImageError(Exception):
    """An image that cannot be used: a documented reject reason (docs/data-build.md) and a message."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


def pil_pixel_limit() -> int:
    """PIL's own decompression-bomb threshold (`Image.MAX_IMAGE_PIXELS`): above it PIL warns, above twice it raises."""
    from PIL import Image

    return Image.MAX_IMAGE_PIXELS


def image_sha256(data: bytes) -> str:
    """The hex sha256 of an image's bytes, as the shards' image_sha256 column holds it."""
    return hashlib.sha256(data).hexdigest()


def decode_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Any:
    """The PIL image of `data`, decoded as Hugging Face `datasets` decodes an Image value (open, load, and the
    EXIF orientation applied when the file records one), so that TRL and this toolkit see the same pixels.

    Raises `ImageError`: `image_bomb` when PIL flags the declared size as a decompression bomb (its
    DecompressionBombWarning or DecompressionBombError, raised before any pixel is decoded), `image_too_large`
    when it declares more than `max_pixels` pixels, `image_unreadable` when PIL cannot identify or fully
    decode it."""
    from PIL import Image, ImageOps, UnidentifiedImageError

    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        try:
            image = Image.open(io.BytesIO(data), formats=IMAGE_FORMATS)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
            raise ImageError(
                "image_bomb",
                f"PIL flags it as a decompression bomb ({e}); such a file declares far more pixels than it holds: "
                "replace it with the real image",
            ) from None
        except UnidentifiedImageError:
            raise ImageError(
                "image_unreadable",
                f"{len(data)} bytes that PIL does not recognise as an image of the formats decoded "
                f"({', '.join(IMAGE_FORMATS)}); convert it to one of them",
            ) from None
        except (OSError, ValueError, SyntaxError) as e:  # PIL's plugins raise these on malformed headers
            raise ImageError("image_unreadable", f"PIL cannot read it ({type(e).__name__}: {e})") from None
        width, height = image.size
        if width * height > max_pixels:
            raise ImageError(
                "image_too_large",
                f"it is {width} x {height} = {width * height} pixels, over --max-image-pixels {max_pixels}; "
                "downscale it, or raise --max-image-pixels",
            )
        try:
            image.load()
            if image.getexif().get(Image.ExifTags.Base.Orientation) is not None:
                image = ImageOps.exif_transpose(image)
        except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:  # a frame past the header's
            raise ImageError("image_bomb", f"PIL flags it as a decompression bomb ({e}); replace it") from None
        except (OSError, ValueError, SyntaxError, EOFError) as e:  # truncated or corrupt pixel data
            raise ImageError(
                "image_unreadable", f"PIL cannot decode its pixels ({type(e).__name__}: {e}); the file is damaged"
            ) from None
    return image
