"""Images of vision pairs: the one decoding of stored image bytes that the build and every reader share."""

from __future__ import annotations

import hashlib
import io
import warnings
from collections.abc import Iterable
from typing import Any

DEFAULT_MAX_IMAGE_PIXELS = 1 << 25
"""The default --max-image-pixels (33,554,432: 8192 x 4096): an image declaring more is rejected as image_too_large."""
DEFAULT_MAX_ROW_IMAGE_PIXELS = 1 << 27
"""The default --max-row-image-pixels (134,217,728: four images at the --max-image-pixels default, or eleven 12 MP
photos): a row whose images declare more together is rejected as row_images_too_large, before any is decoded. It is
what one row's decoded images cost (about 400 MB as RGB) while a worker encodes it or a loader worker reads it."""
MAX_IMAGE_BYTES = 64 << 20
"""The largest image file read (64 MiB); a larger one is rejected as image_too_large before it is read."""
IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
"""The only formats image bytes are decoded as (Pillow's format names), each by Pillow in-process: nothing else is
tried, so no plugin that runs an external program (EPS runs Ghostscript) is ever reached. Another format is an
image_unreadable reject naming these."""


class ImageError(Exception):
    """An image that cannot be used: a documented reject reason (docs/data-build.md) and a message."""

    def __init__(self, reason: str, message: str, index: int | None = None):
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.index = index
        """The image's position in its row (`decode_row`); None for one image alone, or the row as a whole."""


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
    return load_image(open_image(data, max_pixels))


def decode_row(data: Iterable[bytes], max_pixels: int, max_row_pixels: int) -> list[tuple[bytes, Any]]:
    """(bytes, PIL image) of each of one row's images, in order, decoded as `decode_image` decodes them, in memory
    bounded by `max_row_pixels` whatever the row names: each header is read (`open_image`) and the row's pixels
    summed as the images come (every occurrence counts: the processor takes each), so a row over the bound is
    refused before any pixel is decoded and before the rest of `data` is even read; then each distinct image is
    decoded once, a repeated one shared (a small PNG named 40 times was decoded 40 times and held at once).

    Raises `ImageError` with `index` the image's position, or `row_images_too_large` with `index` None."""
    opened, pixels = [], 0
    for k, item in enumerate(data):
        image = _at(k, open_image, item, max_pixels)
        pixels += image.size[0] * image.size[1]
        if pixels > max_row_pixels:
            raise ImageError(
                "row_images_too_large",
                f"its images declare {pixels} pixels together by images[{k}] ({k + 1} images, every occurrence "
                f"counted: the processor takes each), over --max-row-image-pixels {max_row_pixels}; no image of it "
                "was decoded. Use fewer or smaller images in the row, or raise --max-row-image-pixels",
            )
        opened.append((item, image))
    decoded: dict[bytes, Any] = {}
    for k, (item, image) in enumerate(opened):
        if item not in decoded:
            decoded[item] = _at(k, load_image, image)
    return [(item, decoded[item]) for item, _ in opened]


def _at(index: int, step: Any, *args: Any) -> Any:
    """`step(*args)`, an `ImageError` it raises marked with the image's `index` in its row."""
    try:
        return step(*args)
    except ImageError as e:
        raise ImageError(e.reason, e.message, index) from None


def open_image(data: bytes, max_pixels: int = DEFAULT_MAX_IMAGE_PIXELS) -> Any:
    """The PIL image of `data` opened from its header alone (no pixel decoded), its size checked against
    `max_pixels` and PIL's bomb threshold; `ImageError` as `decode_image` raises it."""
    from PIL import Image, UnidentifiedImageError

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
    return image


def load_image(image: Any) -> Any:
    """An `open_image` image decoded: its pixels loaded and its EXIF orientation applied, as `datasets` does."""
    from PIL import Image, ImageOps

    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
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
