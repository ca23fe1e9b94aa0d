"""A model directory's processor (tokenizer, image processor, chat template) loaded as transformers' AutoProcessor
loads it, for building and checking vision datasets."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dpo_data.errors import DataError

PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json")
"""Where `save_pretrained` writes a processor's image settings (transformers 5, and 4)."""


def load_processor(directory: str | Path) -> Any:
    """The processor AutoProcessor loads from `directory`, with an image processor and a fast tokenizer; anything
    else is a named `DataError`.

    A processor that also takes videos (Qwen2-VL, Qwen2.5-VL) needs a video processor, and transformers 5 has
    none without torchvision: it is then loaded without one (the same tokenizer, image processor and settings;
    this toolkit reads images only)."""
    label = f"--processor {directory}"
    if not Path(directory).is_dir():
        raise DataError(f"{label}: not a directory; pass a local model directory saved with its processor")
    if not any((Path(directory) / name).is_file() for name in PROCESSOR_FILES):
        raise DataError(
            f"{label}: holds no image processor ({' or '.join(PROCESSOR_FILES)}), so it cannot read images; pass the "
            "directory a vision-language model and its processor were saved to (processor.save_pretrained), or "
            "build text-only data with --tokenizer"
        )
    from transformers import AutoProcessor

    try:
        processor = AutoProcessor.from_pretrained(directory)
    except (OSError, ImportError, ValueError) as e:
        processor = _without_videos(directory, e)
    for part in ("image_processor", "tokenizer"):
        if getattr(processor, part, None) is None:
            raise DataError(
                f"{label}: AutoProcessor loads a {type(processor).__name__} without a {part.replace('_', ' ')}; a "
                "vision build needs both: pass a vision-language model's directory"
            )
    if getattr(processor.tokenizer, "backend_tokenizer", None) is None:
        raise DataError(f"{label}: its tokenizer is not a fast (Rust) tokenizer, which attestation needs")
    return processor


def _without_videos(directory: str | Path, error: Exception) -> Any:
    """The directory's processor built without its video processor, or the load's own error named."""
    import transformers

    name = _processor_class(directory)
    cls = getattr(transformers, name, None) if name else None
    if cls is None or "video_processor" not in cls.get_attributes():
        raise DataError(f"--processor {directory}: AutoProcessor cannot load it ({type(error).__name__}: {error})")

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        parts = {"image_processor": image_processor, "tokenizer": tokenizer, "video_processor": None}
        cls.__init__(self, **parts, chat_template=chat_template, **kwargs)

    # Named as the family's class, so that what it records (processor_class) is the family's.
    image_only = type(cls.__name__, (cls,), {"__init__": __init__, "__module__": cls.__module__})
    try:
        return image_only.from_pretrained(directory)
    except (OSError, ImportError, ValueError) as e:
        raise DataError(f"--processor {directory}: AutoProcessor cannot load it ({type(e).__name__}: {e})") from None


def _processor_class(directory: str | Path) -> str | None:
    for name in PROCESSOR_FILES:
        try:
            found = json.loads((Path(directory) / name).read_text(encoding="utf-8")).get("processor_class")
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(found, str):
            return found
    return None


def rendering_tokenizer(processor: Any) -> Any:
    """The processor's tokenizer, with the processor's chat template (the one that renders image parts) as its own:
    what a vision build renders and tokenizes with, and attests."""
    tokenizer = processor.tokenizer
    if getattr(processor, "chat_template", None):
        tokenizer.chat_template = processor.chat_template
    return tokenizer
