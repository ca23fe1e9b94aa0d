"""`BuildOptions`, what one `dpo-data build` is asked to do, checked when made, and the image bounds only a vision
build takes."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dpo_data.errors import DataError
from dpo_data.images import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_ROW_IMAGE_PIXELS, pil_pixel_limit
from dpo_data.prepare.columns import check_columns
from dpo_data.prepare.inputs import MAX_ROW_BYTES
from dpo_data.prepare.parts import Part
from dpo_data.prepare.tokenize import OVERLENGTH_MODES

VISION_OPTIONS = {"max_image_pixels": DEFAULT_MAX_IMAGE_PIXELS, "max_row_image_pixels": DEFAULT_MAX_ROW_IMAGE_PIXELS}
"""The options that bound images, with their defaults: a vision build's alone (given to a text build, an error)."""


@dataclass(frozen=True)
class BuildOptions:
    """Options of one build. All but `num_proc`, `overwrite` and `progress` are recorded in the manifest.

    `columns` maps row fields onto the input's column names: {"prompt": "question", ...} or the CLI's
    "prompt=question,chosen=response_j,rejected=response_k"; it is kept as a checked dict in field order.

    `chat_template` is the path of a Jinja file that replaces the tokenizer's chat template (`--chat-template`);
    the manifest records its name, sha256 and text, and the build is refused when it is not prefix-stable.

    `pairs_per_shard` rows read make a span, and each span's pairs one shard (so at most that many pairs a
    shard). `part` builds only every `part.count`-th span from the `part.index`-th, into a part directory.

    `max_image_pixels` bounds the pixels an image of a vision build (`build(..., processor_dir=...)`) may declare,
    `max_row_image_pixels` those a row's images declare together (checked before any is decoded); both are recorded
    for vision builds only."""

    max_length: int | None = None
    overlength: str = "reject"
    append_eos: bool = True
    source: str | None = None
    max_reject_fraction: float | None = None
    pairs_per_shard: int = 100_000
    max_row_bytes: int = MAX_ROW_BYTES
    columns: Mapping[str, str] | str | None = None
    chat_template: str | Path | None = None
    num_proc: int = 1
    overwrite: bool = False
    progress: bool = False
    part: Part | None = None
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_row_image_pixels: int = DEFAULT_MAX_ROW_IMAGE_PIXELS

    def __post_init__(self):
        if self.max_length is not None and self.max_length < 2:
            raise DataError(
                f"--max-length is {self.max_length}; it must be at least 2 (one prompt and one completion token)"
            )
        if self.overlength not in OVERLENGTH_MODES:
            raise DataError(f"--overlength is {self.overlength!r}; allowed: {', '.join(OVERLENGTH_MODES)}")
        if self.max_reject_fraction is not None and not 0.0 <= self.max_reject_fraction <= 1.0:
            raise DataError(f"--max-reject-fraction is {self.max_reject_fraction}; it must lie in [0, 1]")
        if self.pairs_per_shard < 1:
            raise DataError(f"--pairs-per-shard is {self.pairs_per_shard}; it must be at least 1")
        if self.max_row_bytes < 1024:
            raise DataError(f"--max-row-bytes is {self.max_row_bytes}; it must be at least 1024")
        if self.num_proc < 1:
            raise DataError(f"--num-proc is {self.num_proc}; it must be at least 1")
        if self.columns is not None:
            object.__setattr__(self, "columns", check_columns(self.columns))
        # the default needs no check (below PIL's threshold, tests/vision), and a text build no PIL import
        if self.max_image_pixels != DEFAULT_MAX_IMAGE_PIXELS and not 1 <= self.max_image_pixels <= pil_pixel_limit():
            raise DataError(
                f"--max-image-pixels is {self.max_image_pixels}; allowed: 1 to {pil_pixel_limit()} (PIL's "
                "decompression-bomb threshold, above which it flags an image as a bomb whatever this says)"
            )
        if self.max_row_image_pixels < 1:
            raise DataError(
                f"--max-row-image-pixels is {self.max_row_image_pixels}; it must be at least 1 (the pixels a row's "
                f"images may declare together; default {DEFAULT_MAX_ROW_IMAGE_PIXELS})"
            )

    def recorded(self, chat_template: dict | None = None, vision: bool = False) -> dict[str, Any]:
        """The options that shape the output (recorded in the manifest; --num-proc never changes a byte), with
        the override template as `read_chat_template` read it; the `VISION_OPTIONS` for a vision build only, so a
        text build records what it always did."""
        skip = {"num_proc", "overwrite", "progress", "chat_template", "part"}
        if not vision:
            skip.update(VISION_OPTIONS)
        if self.columns is None:
            skip.add("columns")  # left out, not null: a build without a mapping records what it always did
        options = {k: v for k, v in asdict(self).items() if k not in skip}
        if chat_template is not None:  # likewise only when given
            options["chat_template"] = chat_template
        return options


def pixels_without_processor(value: int, name: str = "max_image_pixels") -> DataError:
    """An image bound (`VISION_OPTIONS`, by its field name) given to a text build, which has no images to bound (it
    would be ignored)."""
    option = "--" + name.replace("_", "-")
    return DataError(
        f"{option} {value}: it applies only to a vision build (--processor DIR), and this build is a text "
        f"build (--tokenizer DIR); drop {option}, or build data with images with --processor DIR"
    )
