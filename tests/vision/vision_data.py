"""Vision preference rows on disk: image files (PNG, JPEG), JSON lines naming them, Parquet with binary images and a
Hugging Face `datasets` save_to_disk directory of Image values; and the reference ids TRL 1.16 would make."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import orjson
import pyarrow as pa
import pyarrow.parquet as pq


def user(*parts) -> list[dict]:
    """A one-message prompt whose content is parts: an image placeholder for None, text for a string."""
    return [
        {"role": "user", "content": [{"type": "image"} if p is None else {"type": "text", "text": p} for p in parts]}
    ]


def answer(text: str) -> list[dict]:
    return [{"role": "assistant", "content": text}]


def row(prompt: list, chosen: str, rejected: str, images: list | None = None, **extra) -> dict:
    found = {"prompt": prompt, "chosen": answer(chosen), "rejected": answer(rejected), **extra}
    if images is not None:
        found["images"] = images
    return found


JPEG_MAGIC = b"\xff\xd8"


def write_images(directory: Path, images: list[bytes]) -> list[str]:
    """The sample images as files under `directory`/img (PNG or JPEG as encoded), their names relative to it."""
    (directory / "img").mkdir(parents=True, exist_ok=True)
    names = []
    for i, data in enumerate(images):
        suffix = "jpg" if data.startswith(JPEG_MAGIC) else "png"
        name = f"img/{i}.{suffix}"
        (directory / name).write_bytes(data)
        names.append(name)
    return names


def jsonl_rows(names: list[str]) -> list[dict]:
    """Rows naming image files: explicit image parts, TRL's implicit placement (string content), several images,
    an image in a multi-turn history, a system message, and a conversation without images."""
    return [
        row(user(None, "What is in the picture?"), "A field of noise.", "A cat.", [names[0]]),
        row([{"role": "user", "content": "Compare these two."}], "They differ.", "They match.", names[1:3]),
        row(user("First", None, "then", None, "."), "Two pictures.", "One picture.", [names[2], names[3]]),
        row(
            [
                {"role": "system", "content": "You describe images."},
                *user(None, "Describe it."),
                {"role": "assistant", "content": "Noise."},
                # parts, not a string: TRL 1.16 would put the image again before a later user message's string
                *user("And this one?"),
            ],
            "Also noise.",
            "A landscape.",
            [names[1]],
        ),
        row([{"role": "user", "content": "No picture: what is 2 + 2?"}], "4.", "5."),
        {
            "chosen": [*user(None, "Colour?"), *answer("Grey.")],
            "rejected": [*user(None, "Colour?"), *answer("Red.")],
            "images": [names[3]],
        },
    ]


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in rows))
    return path


def write_parquet(path: Path, images: list[bytes]) -> Path:
    """Rows whose images are Parquet binary values (list<binary>)."""
    rows = [
        row(user(None, "Binary picture?"), "Yes.", "No.", [images[0]]),
        row(user(None, None, "Two binary pictures?"), "Yes, two.", "No.", [images[3], images[1]]),
    ]
    table = pa.Table.from_pylist(rows)
    assert table.schema.field("images").type == pa.list_(pa.binary())
    pq.write_table(table, path)
    return path


def write_hf_dataset(path: Path, images: list[bytes]) -> Path:
    """A `datasets` save_to_disk directory whose images column is List(Image()): {"bytes", "path"} structs, and
    whose content parts carry the null keys Arrow structs give them."""
    from datasets import Dataset, Image, List

    def parts(*items):
        return [{"type": "image", "text": None} if p is None else {"type": "text", "text": p} for p in items]

    rows = [
        {
            "images": [{"bytes": images[2], "path": "picture.png"}],
            "prompt": [{"role": "user", "content": parts(None, "From the hub?")}],
            "chosen": [{"role": "assistant", "content": parts("Saved with datasets.")}],
            "rejected": [{"role": "assistant", "content": parts("No idea.")}],
        }
    ]
    Dataset.from_list(rows).cast_column("images", List(Image())).save_to_disk(str(path))
    return path


def vision_inputs(directory: Path, images: list[bytes]) -> list[Path]:
    """Every input kind: JSON lines naming files, Parquet with binary images, a save_to_disk directory."""
    names = write_images(directory, images)
    return [
        write_jsonl(directory / "files.jsonl", jsonl_rows(names)),
        write_parquet(directory / "binary.parquet", images),
        write_hf_dataset(directory / "hub", images),
    ]


def png_header(width: int, height: int, rows: bytes | None = None) -> bytes:
    """A 1-bit grayscale PNG declaring `width` x `height`; `rows` its raw (filtered) rows, else one zero byte (PIL
    reads a PNG's size from its header before any pixel)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    header = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    data = zlib.compress(rows if rows is not None else b"\x00", 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", data) + chunk(b"IEND", b"")


def bomb_png(side: int = 20_000) -> bytes:
    """A real decompression bomb: a complete black `side` x `side` 1-bit PNG (50 MB of pixels) in ~50 KB."""
    line = b"\x00" * (1 + (side + 7) // 8)
    return png_header(side, side, line * side)


def trl_ids(processor, raw: dict, images: list) -> tuple[list[int], list[int], list[int]]:
    """(prompt, prompt + chosen, prompt + rejected) ids of a row as TRL 1.16's vision collator makes them: its
    `prepare_multimodal_messages`, the processor's chat template, then `processor(text=..., images=...)` with no
    special tokens added."""
    from trl.data_utils import prepare_multimodal_messages

    if "prompt" not in raw:  # implicit prompt: the shared turns
        shared = next(i for i, (a, b) in enumerate(zip(raw["chosen"], raw["rejected"])) if a != b)
        raw = {"prompt": raw["chosen"][:shared], "chosen": raw["chosen"][shared:], "rejected": raw["rejected"][shared:]}
    prompt = prepare_multimodal_messages(raw["prompt"], images=images)
    texts = [processor.apply_chat_template(prompt, tokenize=False, add_generation_prompt=True)]
    for part in ("chosen", "rejected"):
        texts.append(processor.apply_chat_template(prompt + prepare_multimodal_messages(raw[part]), tokenize=False))
    out = processor(text=texts, images=[images] * 3 if images else None, add_special_tokens=False)
    return tuple(list(map(int, ids)) for ids in out["input_ids"])


def pil(data: bytes):
    from PIL import Image

    return Image.open(io.BytesIO(data))
