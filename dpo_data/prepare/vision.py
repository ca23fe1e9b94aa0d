"""Vision pairs: a row's images read and checked, its messages put in TRL's multimodal shape, and its ids made by the
processor (chat template, image placeholder expansion) exactly as `processor(text=..., images=...)` makes them."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from dpo_data.images import DEFAULT_MAX_ROW_IMAGE_PIXELS, MAX_IMAGE_BYTES, ImageError, decode_row, image_sha256
from dpo_data.prepare.inputs import HF_DATASET, InputFile
from dpo_data.prepare.rows import Pair, RowReject, content_text
from dpo_data.prepare.tokenize import EncodedPair, PairEncoder, _special_text

IMAGE_SHAPES = (
    'a file path relative to the input file, a {"bytes": ..., "path": ...} object (a Hugging Face datasets Image '
    "value) or a binary value (Parquet, Arrow)"
)


@dataclasses.dataclass(frozen=True)
class RowImage:
    """One image of a row: its original bytes, their hex sha256, and the PIL image decoded from them."""

    data: bytes
    sha256: str
    image: Any


def read_images(
    pair: Pair, inp: InputFile, max_pixels: int, max_row_pixels: int = DEFAULT_MAX_ROW_IMAGE_PIXELS
) -> list[RowImage]:
    """The pair's images, read (a path relative to the input's directory), decoded and checked, in order, in memory
    bounded by `max_row_pixels` (`decode_row`: headers first, each file read once per row, each distinct image
    decoded once); the first problem is a `RowReject` naming the image, the value and the fix."""
    base = Path(inp.path) if inp.format == HF_DATASET else Path(inp.path).parent
    files: dict[str, bytes] = {}  # a path named again is read once: its bytes are shared, and so is its decoding

    def data() -> Iterator[bytes]:
        for i, value in enumerate(pair.images):
            key = value if isinstance(value, str) else None
            if key not in files:
                found = _image_data(f"images[{i}]", value, base)
                if key is None:
                    yield found
                    continue
                files[key] = found
            yield files[key]

    try:
        decoded = decode_row(data(), max_pixels, max_row_pixels)
    except ImageError as e:
        where = "the row" if e.index is None else f"images[{e.index}] ({_named(pair.images[e.index])})"
        raise RowReject(e.reason, f"{where}: {e.message}") from None
    return [RowImage(item, image_sha256(item), image) for item, image in decoded]


def _named(value: Any) -> str:
    """An image value for a message: its path, or its size."""
    if isinstance(value, dict):
        value = value.get("path") if value.get("bytes") is None else value["bytes"]
    if isinstance(value, (bytes, bytearray)):
        return f"{len(value)} bytes"
    return repr(value)[:200]


def _image_data(where: str, value: Any, base: Path) -> bytes:
    """The bytes an image value stands for: inline bytes, or the file a relative path names."""
    if isinstance(value, dict) and set(value) <= {"bytes", "path"}:
        if isinstance(value.get("bytes"), (bytes, bytearray)):
            return _bounded(where, bytes(value["bytes"]))
        if value.get("bytes") is None and isinstance(value.get("path"), str):
            return _read_file(where, value["path"], base)
    elif isinstance(value, (bytes, bytearray)):
        return _bounded(where, bytes(value))
    elif isinstance(value, str):
        return _read_file(where, value, base)
    raise RowReject("wrong_type", f"{where} is {value!r:.120}; an image is {IMAGE_SHAPES}")


def _bounded(where: str, data: bytes) -> bytes:
    if len(data) > MAX_IMAGE_BYTES:
        raise RowReject(
            "image_too_large", f"{where} has {len(data)} bytes, over the {MAX_IMAGE_BYTES}-byte limit of an image file"
        )
    return data


def _read_file(where: str, name: str, base: Path) -> bytes:
    """A file named relative to `base` that stays inside it (a shared dataset must not pull other files into its
    shards: '../../home/me/.ssh/id_rsa' is refused, as is a link out of `base`)."""
    path = Path(name)
    try:
        inside = not path.is_absolute() and base.resolve() in (base / path).resolve().parents
    except (RuntimeError, OSError, ValueError) as e:  # a symlink loop (RuntimeError on 3.11), a NUL byte (ValueError)
        raise RowReject(
            "image_unreadable",
            f"{where} is {name!r:.200}, a path that cannot be resolved ({type(e).__name__}: {e}); name a file inside "
            "the input's directory",
        ) from None
    if not inside:
        raise RowReject(
            "image_path_outside",
            f"{where} is {name!r:.200}, which lies outside the input's directory {base}; image paths are relative to "
            "the input file and stay inside its directory: copy the image there, or give its bytes",
        )
    file = base / path
    try:
        size = file.stat().st_size
        if not file.is_file():
            raise FileNotFoundError
        if size > MAX_IMAGE_BYTES:
            raise RowReject(
                "image_too_large",
                f"{where} is {name!r:.200}, a file of {size} bytes, over the {MAX_IMAGE_BYTES}-byte limit of an image",
            )
        return file.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        raise RowReject(
            "image_missing",
            f"{where} is {name!r:.200}, but {file} is not a file; image paths are relative to the input file "
            f"({base}): fix the path or add the file",
        ) from None
    except OSError as e:
        raise RowReject("image_unreadable", f"{where} is {name!r:.200}, which cannot be read ({e.strerror})") from None


# -- messages --------------------------------------------------------------------------------------


def multimodal(pair: Pair) -> Pair:
    """The pair with every message's content as a list of parts, as TRL 1.16's `prepare_multimodal_messages` puts
    it before rendering: a string becomes one text part, and a prompt that holds no image part gets one image
    part per image before the text of its first user message. The prompt's image parts must then be as many as
    the row's images (`image_count_mismatch`)."""
    prompt = [_as_parts(m) for m in pair.prompt]
    count = sum(_image_parts(m) for m in prompt)
    if pair.images and count == 0 and all(isinstance(m.get("content"), str) for m in pair.prompt):
        first = next(i for i, m in enumerate(prompt) if m["role"] == "user")
        images = [{"type": "image"} for _ in pair.images]
        prompt[first] = {**prompt[first], "content": images + prompt[first]["content"]}
        count = len(pair.images)
    if count != len(pair.images):
        raise RowReject(
            "image_count_mismatch",
            f'the prompt holds {count} image parts ({{"type": "image"}}) and field \'images\' {len(pair.images)} '
            "images; each image part takes the next image, in order: make them as many (or give the prompt no image "
            "part, and the images go before the first user message's text, as TRL places them)",
        )
    chosen, rejected = ([_as_parts(m) for m in part] for part in (pair.chosen, pair.rejected))
    return dataclasses.replace(pair, prompt=prompt, chosen=chosen, rejected=rejected)


def _as_parts(message: dict) -> dict:
    if isinstance(message.get("content"), str):
        return {**message, "content": [{"type": "text", "text": message["content"]}]}
    return message


def _image_parts(message: dict) -> int:
    content = message.get("content")
    return sum(part["type"] == "image" for part in content) if isinstance(content, list) else 0


# -- ids --------------------------------------------------------------------------------------------


class VisionEncoder:
    """Encodes conversational pairs with the processor: rendered by `encoder`'s renderer (the processor's chat
    template) with the same prefix-stability and tool checks as text pairs, the prompt's ids made by the processor
    with the pair's images (so each image placeholder is expanded exactly as the processor expands it for that
    image), the completions' ids by its tokenizer after the prompt. Plain-text pairs without images go to `encoder`.
    """

    def __init__(
        self, encoder: PairEncoder, processor: Any, max_pixels: int, max_row_pixels: int = DEFAULT_MAX_ROW_IMAGE_PIXELS
    ):
        self.encoder, self.processor = encoder, processor
        self.max_pixels, self.max_row_pixels = max_pixels, max_row_pixels
        self.image_token = processor.image_token
        self.image_token_id = processor.tokenizer.convert_tokens_to_ids(self.image_token)

    def encode(self, pair: Pair, inp: InputFile) -> EncodedPair:
        """The pair's ids and images, or a `RowReject`."""
        images = read_images(pair, inp, self.max_pixels, self.max_row_pixels)
        pair = multimodal(pair)
        self._check_content(pair)
        encoder = self.encoder
        with encoder._renderer.row():
            try:
                prompt, chosen, rejected = encoder._render(pair)
            except RowReject as reject:
                encoder._count_failure(reject)
                raise
        self._check_placeholders(prompt, chosen, rejected, len(images))
        pil = [image.image for image in images]
        prompt_ids = self._ids([prompt], pil)[0]
        ids = self._split(prompt, chosen, rejected, prompt_ids, pil)
        self._check_length(*ids, len(images))
        encoded = encoder._finish(*ids)
        return dataclasses.replace(encoded, images=tuple((image.data, image.sha256) for image in images))

    def _check_content(self, pair: Pair) -> None:
        """Special-token text in a message's text would become that token: the processor tokenizes the rendering
        whole (an image placeholder typed as text would take an image's place)."""
        specials = self.encoder._special_re
        for field in ("prompt", "chosen", "rejected"):
            for i, m in enumerate(getattr(pair, field)):
                found = specials and _special_text(specials, content_text(m))
                if found:
                    raise RowReject(
                        "control_text_in_vision_content",
                        f"{field}[{i}] holds the special-token text {found!r} in its text; in a vision row the "
                        "processor tokenizes the rendering whole, so it would become that token (an image "
                        "placeholder, a turn marker): remove it",
                    )

    def _check_placeholders(self, prompt: str, chosen: str, rejected: str, images: int) -> None:
        """The chat template must write one placeholder per image part, all in the prompt."""
        written = prompt.count(self.image_token)
        if written != images:
            raise RowReject(
                "image_count_mismatch",
                f"the chat template writes {written} image placeholders ({self.image_token!r}) for the prompt's "
                f"{images} image parts; the processor's chat template must render each image part once: use the "
                "model's own processor directory",
            )
        for field, full in (("chosen", chosen), ("rejected", rejected)):
            if full[len(prompt) :].count(self.image_token):
                raise RowReject(
                    "image_count_mismatch",
                    f"the chat template writes an image placeholder into the {field} completion; completions are text",
                )

    def _ids(self, texts: list[str], images: list) -> list[list[int]]:
        """The processor's ids of `texts`, each with the pair's images, as TRL 1.16 calls it (no special tokens
        added: the chat template wrote them)."""
        try:
            encoded = self.processor(
                text=texts, images=[images] * len(texts) if images else None, add_special_tokens=False
            )
        except (ValueError, TypeError, IndexError, RuntimeError) as e:  # its own checks of text against images
            raise RowReject(
                "image_count_mismatch", f"the processor refuses the row's text and images ({type(e).__name__}: {e})"
            ) from None
        return [list(map(int, ids)) for ids in encoded["input_ids"]]

    def _split(self, prompt: str, chosen: str, rejected: str, prompt_ids: list[int], images: list) -> tuple:
        """(prompt, chosen, rejected) ids with the prompt's ids a prefix of each full rendering's. The renderings
        share the prompt up to its last special token, past every image: their tails are tokenized alone
        (shared_head.py) and the full ids are the prompt's head + a tail. Where that does not apply, the
        processor tokenizes each full rendering with the images."""
        encoder = self.encoder
        cut = encoder._split.boundary(prompt)
        if cut and self.image_token not in prompt[cut:]:
            texts = [prompt[cut:], chosen[cut:], rejected[cut:]]
            tails = [e.ids for e in encoder._template.encode_batch_fast(texts, add_special_tokens=False)]
            n = len(tails[0])
            if n <= len(prompt_ids) and prompt_ids[len(prompt_ids) - n :] == tails[0]:
                return encoder._split_tails(prompt_ids[: len(prompt_ids) - n], tails[1], tails[2], tails[0])
        return encoder._split_prefix(prompt_ids, *self._ids([chosen, rejected], images))

    def _check_length(self, prompt: list[int], chosen: list[int], rejected: list[int], images: int) -> None:
        """A prompt with images is never truncated (that would cut an image's placeholders from its pixels): over
        --max-length it is rejected whatever --overlength says."""
        limit, longest = self.encoder.options.max_length, max(len(chosen), len(rejected))
        if not images or limit is None or len(prompt) + longest <= limit or longest >= limit:
            return  # `_finish` decides (a completion alone too long is completion_too_long)
        image_tokens = prompt.count(self.image_token_id)
        raise RowReject(
            "too_long",
            f"prompt ({len(prompt)} tokens, {image_tokens} of them the expanded placeholders of its {images} images) "
            f"+ longest completion ({longest}) = {len(prompt) + longest} tokens exceeds --max-length {limit}; a "
            "prompt with images is never truncated: raise --max-length, use smaller images (or a processor with "
            "fewer pixels per image), or drop the row",
        )
