"""One chunk of a build's rows -> its pairs as a block and its rejects, in a worker process (or the build's own):
parse, check, rename columns, render, tokenize (and, in a vision build, read the images)."""

from __future__ import annotations

import os
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import orjson

from dpo_data.dataset.shards import PARTS, PairBlock
from dpo_data.errors import DataError
from dpo_data.prepare.columns import rename_columns
from dpo_data.prepare.inputs import InputFile, OversizedLine, row_size
from dpo_data.prepare.options import BuildOptions
from dpo_data.prepare.rows import RowReject, normalize_row
from dpo_data.prepare.tokenize import PairEncoder, TokenizeOptions
from dpo_data.prepare.vision import VisionEncoder

RAW_KEEP_CHARS = 2000  # what a reject keeps of its raw row

_worker: dict[str, Any] = {}


def init_worker(tokenizer: Any, options: BuildOptions, inputs: list[InputFile], processor: Any = None) -> None:
    """Set up this process's encoders (the build process itself, or a forked pool worker)."""
    topts = TokenizeOptions(options.max_length, options.overlength, options.append_eos, options.max_row_bytes)
    encoder = PairEncoder(tokenizer, topts, override=options.chat_template)
    vision = None
    if processor is not None:
        vision = VisionEncoder(encoder, processor, options.max_image_pixels, options.max_row_image_pixels)
    _worker.update(encoder=encoder, vision=vision, options=options, inputs=inputs)


@dataclass
class ChunkResult:
    """A worker's output for one chunk (rows of one span): its pairs as a block (source ids not yet assigned),
    the source name and truncated-prompt count of each pair, and its rejects, all in input order."""

    span: int
    block: PairBlock
    sources: list[str]
    truncated: list[int]
    rejects: list[tuple[int, dict]]
    columns: dict[int, Counter]
    """Per input index: how many of the chunk's rows (objects) have each column."""
    rendered: int = 0
    """Rows of the chunk whose renderings the chat template made."""
    forms: list[str] = field(default_factory=list)
    """The row form of each pair (`rows.FORMS`), in input order."""


def init_pool_worker(tokenizer: Any, options: BuildOptions, inputs: list[InputFile], processor: Any) -> None:
    """One pool worker per core: its Rust tokenizer stays single-threaded, or N workers would each
    start a thread per core and fight over them (measured: 20% more CPU time at 2 workers)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    init_worker(tokenizer, options, inputs, processor)


def process_chunk(chunk: tuple[int, list[tuple[int, int, int, Any]]]) -> ChunkResult:
    """Parse, validate and encode a chunk of rows: (span, [(input index, row number, global row, item)])."""
    inputs, options, encoder = _worker["inputs"], _worker["options"], _worker["encoder"]
    rejects, pairs, where, columns = [], [], [], {}
    span, rows = chunk
    for input_index, number, row_index, item in rows:
        inp = inputs[input_index]
        row = None
        try:
            row = _parse(item, options.max_row_bytes)
            if isinstance(row, dict):
                columns.setdefault(input_index, Counter()).update(row.keys())
            pairs.append(normalize_row(rename_columns(row, options.columns) if options.columns else row))
            where.append((input_index, number, row_index, item))
        except RowReject as reject:
            rejects.append(_reject(input_index, inp, number, _row_source(row, inp), reject, item))
    kept, sources, forms, truncated, ids = [], [], [], [], {part: [] for part in PARTS}
    images = None if _worker["vision"] is None else []
    before = encoder.rendered_rows
    results = _encode(pairs, [(inputs[i], n) for i, n, _, _ in where])
    for (input_index, number, row_index, item), pair, encoded in zip(where, pairs, results):
        source = pair.source or inputs[input_index].source
        if isinstance(encoded, RowReject):
            rejects.append(_reject(input_index, inputs[input_index], number, source, encoded, item))
            continue
        lengths = (len(encoded.prompt), len(encoded.chosen), len(encoded.rejected))
        kept.append((input_index, number, row_index, pair.id, *lengths))
        sources.append(source)
        forms.append(pair.form)
        truncated.append(encoded.truncated_prompt_tokens)
        for part in PARTS:
            ids[part].extend(getattr(encoded, part))
        if images is not None:
            images.append(encoded.images)
    rejects.sort(key=lambda r: (r[0], r[1][inputs[r[0]].locator]))  # input order, whichever stage rejected
    rendered = encoder.rendered_rows - before
    return ChunkResult(span, _block(kept, ids, images), sources, truncated, rejects, columns, rendered, forms)


def _encode(pairs: list, places: list[tuple[InputFile, int]]) -> list:
    """Each pair's `EncodedPair` or `RowReject`: by the text encoder, or in a vision build by the vision encoder
    (every conversation). A text build refuses a row with images by name (a `DataError`) and rejects content
    given as parts."""
    encoder, vision = _worker["encoder"], _worker["vision"]
    results: list[Any] = [None] * len(pairs)
    text = []
    for i, (pair, (inp, number)) in enumerate(zip(pairs, places)):
        if vision is None and pair.images:
            raise _images_need_processor(pair, inp, number)
        if vision is None and pair.vision:
            results[i] = RowReject(
                "wrong_type",
                "a message's content is a list of parts, which only a vision build reads: write each content as a "
                "string, or build with --processor DIR (a vision-language model's processor)",
            )
        elif vision is None or pair.kind == "text":
            text.append(i)
        else:
            try:
                results[i] = vision.encode(pair, inp)
            except RowReject as reject:
                results[i] = reject
    for i, result in zip(text, encoder.encode_many([pairs[i] for i in text])):
        results[i] = result
    return results


def _images_need_processor(pair: Any, inp: InputFile, number: int) -> DataError:
    return DataError(
        f"{inp.path} {inp.locator} {number} has {len(pair.images)} images, but the build was given a tokenizer "
        "(--tokenizer), which cannot read them; build vision data with --processor DIR, the model directory holding "
        "the vision-language model's processor (docs/data-build.md, vision pairs)"
    )


def _block(kept: list[tuple], ids: dict[str, list[int]], images: list | None = None) -> PairBlock:
    return PairBlock(
        source_id=np.zeros(len(kept), dtype=np.int32),
        row_index=np.array([k[2] for k in kept], dtype=np.int64),
        input_index=np.array([k[0] for k in kept], dtype=np.int32),
        input_row=np.array([k[1] for k in kept], dtype=np.int64),
        lengths=np.array([k[4:] for k in kept], dtype=np.int32).reshape(-1, 3),
        row_id=[k[3] for k in kept],
        **{part: np.array(ids[part], dtype=np.int32) for part in PARTS},
        image_bytes=None if images is None else [[data for data, _ in pair] for pair in images],
        image_sha256=None if images is None else [[digest for _, digest in pair] for pair in images],
    )


def _row_source(row: Any, inp: InputFile) -> str:
    """The source a rejected row is counted under: its own valid 'source' field, else its input's."""
    own = row.get("source") if isinstance(row, dict) else None
    return own if isinstance(own, str) and own.strip() else inp.source


def _parse(item: Any, max_row_bytes: int) -> Any:
    if isinstance(item, OversizedLine):
        raise RowReject("row_too_large", f"the row has {item.size} bytes, over --max-row-bytes {max_row_bytes}")
    if not isinstance(item, bytes):  # .json / .parquet rows arrive parsed
        size = row_size(item)
        if size > max_row_bytes:
            raise RowReject(
                "row_too_large",
                f"the row has {size} bytes (its JSON, a binary value counted by its length), over --max-row-bytes "
                f"{max_row_bytes}",
            )
        return item
    try:
        item.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RowReject(
            "invalid_utf8", f"the line is not valid UTF-8 (byte {e.start}: {item[e.start : e.start + 1]!r})"
        ) from None
    try:
        return orjson.loads(item)
    except orjson.JSONDecodeError as e:
        raise RowReject("invalid_json", f"the line is not valid JSON: {e}") from None


def _reject(
    input_index: int, inp: InputFile, number: int, source: str, reject: RowReject, item: Any
) -> tuple[int, dict]:
    record = {
        "file": inp.path,
        inp.locator: number,
        "source": source,
        "reason": reject.reason,
        "message": reject.message,
        "raw": _raw_text(item),
    }
    return input_index, record


def _raw_text(item: Any) -> str:
    if isinstance(item, OversizedLine):
        text, total = item.head.decode("utf-8", "backslashreplace"), item.size
    elif isinstance(item, bytes):
        text, total = item.decode("utf-8", "backslashreplace"), len(item)
    else:
        text = orjson.dumps(item, default=str).decode()
        total = len(text)
    if len(text) > RAW_KEEP_CHARS or total > len(text):
        return text[:RAW_KEEP_CHARS] + f"...[truncated; {total} in all]"
    return text
