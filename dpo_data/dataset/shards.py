"""Arrow IPC shards of tokenized pairs: the on-disk schema, columnar pair blocks, a deterministic writer, a reader.

A shard holds the pairs of one span of consecutive input rows (rows `span * rows_per_shard` on, in the global
row order over every input), with source ids local to the shard: its bytes depend on its span's rows alone, so a
shard written by one task of a `--part` build is the shard a single build writes (docs/data-build.md)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np
import pyarrow as pa

from dpo_data.errors import DataError
from dpo_state.digest import file_digest

RECORD_BATCH_ROWS = 1024  # fixed, so batch boundaries (and bytes) never depend on --num-proc
RECORD_BATCH_IMAGE_BYTES = 64 << 20
"""A vision shard's record batch ends before the pair whose images would take its image bytes over this (64 MiB),
as well as at RECORD_BATCH_ROWS; a pair whose images alone are over it is a batch of its own. It bounds what the
writer and `dpo-data verify` hold of a shard at once (docs/data-build.md, storage); text shards are untouched."""
SHARD_DIR = "shards"

SHARD_SCHEMA = pa.schema(
    [
        pa.field("row_index", pa.int64(), nullable=False),
        pa.field("source_id", pa.int32(), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("chosen_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("rejected_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("prompt_len", pa.int32(), nullable=False),
        pa.field("chosen_len", pa.int32(), nullable=False),
        pa.field("rejected_len", pa.int32(), nullable=False),
        pa.field("input_index", pa.int32(), nullable=False),
        pa.field("input_row", pa.int64(), nullable=False),
        pa.field("row_id", pa.string(), nullable=True),
    ]
)
PARTS = ("prompt", "chosen", "rejected")
IMAGE_COLUMNS = ("image_bytes", "image_sha256")
VISION_SHARD_SCHEMA = pa.schema(
    [
        *SHARD_SCHEMA,
        # large_binary: one pair's images may pass 2 GiB (int32 offsets would not); batches are bounded by bytes
        pa.field("image_bytes", pa.list_(pa.large_binary()), nullable=False),
        pa.field("image_sha256", pa.list_(pa.string()), nullable=False),
    ]
)
"""The shards of a vision dataset (built with --processor): SHARD_SCHEMA, then each pair's images' original bytes
and their hex sha256, in placeholder order (docs/data-build.md, shard columns)."""


def shard_schema(vision: bool) -> pa.Schema:
    return VISION_SHARD_SCHEMA if vision else SHARD_SCHEMA


@dataclass
class PairBlock:
    """Consecutive pairs in columnar form: per-pair arrays plus each part's ids concatenated.

    Workers hand pairs over in this form so that ids cross process boundaries as a few int32 buffers,
    never as Python lists of ints.
    """

    source_id: np.ndarray  # int32 [n]: the shard's own ids (`ShardWriter` assigns them)
    row_index: np.ndarray  # int64 [n]: the row's position in the global row order over every input
    input_index: np.ndarray  # int32 [n]
    input_row: np.ndarray  # int64 [n]
    lengths: np.ndarray  # int32 [n, 3]: prompt, chosen, rejected
    prompt: np.ndarray  # int32 [sum of prompt lengths]
    chosen: np.ndarray
    rejected: np.ndarray
    row_id: list
    image_bytes: list | None = None
    """Vision datasets: per pair, its images' bytes in placeholder order (None in a text dataset's blocks)."""
    image_sha256: list | None = None
    """Vision datasets: per pair, the hex sha256 of each of its images."""

    def __len__(self) -> int:
        return len(self.row_id)

    @staticmethod
    def concat(blocks: list[PairBlock]) -> PairBlock:
        if len(blocks) == 1:
            return blocks[0]
        joined = {}
        for f in fields(PairBlock):
            values = [getattr(b, f.name) for b in blocks]
            if isinstance(values[0], np.ndarray):
                joined[f.name] = np.concatenate(values)
            else:  # lists (row ids, images), or None in every block
                joined[f.name] = None if values[0] is None else [item for value in values for item in value]
        return PairBlock(**joined)

    def split(self, k: int) -> tuple[PairBlock, PairBlock]:
        """The first k pairs and the rest."""
        cut = self.lengths[:k].sum(axis=0)
        head, tail = {}, {}
        for f in fields(PairBlock):
            value = getattr(self, f.name)
            at = int(cut[PARTS.index(f.name)]) if f.name in PARTS else k
            head[f.name], tail[f.name] = (None, None) if value is None else (value[:at], value[at:])
        return PairBlock(**head), PairBlock(**tail)

    def record_batch(self) -> pa.RecordBatch:
        columns = [
            _numbers(self.row_index),
            _numbers(self.source_id),
            *(_list_array(self.lengths[:, j], getattr(self, part)) for j, part in enumerate(PARTS)),
            *(_numbers(self.lengths[:, j]) for j in range(3)),
            _numbers(self.input_index),
            _numbers(self.input_row),
            _strings(self.row_id),
        ]
        if self.image_bytes is None:
            return pa.RecordBatch.from_arrays(columns, schema=SHARD_SCHEMA)
        columns += [
            pa.array(self.image_bytes, type=VISION_SHARD_SCHEMA.field("image_bytes").type),
            pa.array(self.image_sha256, type=VISION_SHARD_SCHEMA.field("image_sha256").type),
        ]
        return pa.RecordBatch.from_arrays(columns, schema=VISION_SHARD_SCHEMA)


# The columns are built from their buffers, not with `pa.array`: it looks for pandas on every call, and the
# first look imports it (a third of a second of a small build's start). The shards' bytes are the same.


def _numbers(values: np.ndarray) -> pa.Array:
    """A numeric array without nulls over `values`' bytes (copied contiguous)."""
    values = np.ascontiguousarray(values)
    return pa.Array.from_buffers(pa.from_numpy_dtype(values.dtype), len(values), [None, pa.py_buffer(values)])


def as_numpy(array: pa.Array | pa.ChunkedArray) -> np.ndarray:
    """A null-free integer or float column as numpy: a read-only view of its buffer (a chunked one concatenated);
    `_numbers`' inverse. Why not `to_numpy`: pyarrow converts through its pandas bridge, which imports pandas (about
    0.4 s of every process that reads a shard, each training rank), though the result is numpy."""
    if isinstance(array, pa.ChunkedArray):
        chunks = [as_numpy(chunk) for chunk in array.chunks]
        return np.concatenate(chunks) if chunks else np.empty(0, array.type.to_pandas_dtype())
    if not (pa.types.is_integer(array.type) or pa.types.is_floating(array.type)):
        raise TypeError(f"as_numpy reads integer or float columns, not {array.type}")
    if array.null_count:  # the shard schema's columns are all non-null: a file that holds nulls was not built so
        raise DataError(f"a shard column holds {array.null_count} nulls; rebuild the dataset (dpo-data build)")
    dtype = np.dtype(array.type.to_pandas_dtype())
    if not len(array):
        return np.empty(0, dtype)
    return np.frombuffer(array.buffers()[1], dtype)[array.offset : array.offset + len(array)]


def _strings(values: list) -> pa.StringArray:
    """A string array of `values` (None: null)."""
    valid = np.array([v is not None for v in values], dtype=bool)
    data = [v.encode() if v is not None else b"" for v in values]
    offsets = np.zeros(len(data) + 1, dtype=np.int32)
    np.cumsum([len(d) for d in data], out=offsets[1:])
    nulls = len(values) - int(valid.sum())
    bitmap = pa.py_buffer(np.packbits(valid, bitorder="little")) if nulls else None
    return pa.StringArray.from_buffers(len(values), pa.py_buffer(offsets), pa.py_buffer(b"".join(data)), bitmap, nulls)


def _list_array(lengths: np.ndarray, values: np.ndarray) -> pa.ListArray:
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    return pa.ListArray.from_arrays(_numbers(offsets), _numbers(values))


@dataclass(frozen=True)
class ShardInfo:
    """What the manifest records of a finished shard."""

    path: str
    rows: int
    bytes: int
    sha256: str
    first_pair_index: int
    sources: list[str]
    """Source names by the shard's own `source_id`: 0 is the first source appearing in the shard."""
    span: int


def shard_name(span: int) -> str:
    return f"{SHARD_DIR}/shard-{span:05d}.arrow"


def batch_rows(image_bytes: np.ndarray, budget: int) -> int:
    """The pairs of a vision shard's next record batch, given the next pairs' image bytes (each pair's total, in
    order): at most RECORD_BATCH_ROWS and no more than fit in `budget` (RECORD_BATCH_IMAGE_BYTES), but at least
    one. A pure function of the pairs, so a shard's bytes never depend on how they arrived (--num-proc, --part)."""
    fitting = int(np.searchsorted(np.cumsum(image_bytes[:RECORD_BATCH_ROWS]), budget, side="right"))
    return max(1, fitting)


class ShardWriter:
    """Writes pairs in arrival order into one shard per span (uncompressed IPC files); a span no pair
    survived writes none.

    Record batches hold `RECORD_BATCH_ROWS` rows (fewer at a shard's end) and, in a vision shard, at most
    `RECORD_BATCH_IMAGE_BYTES` of images (`batch_rows`), whatever the sizes of the blocks handed in, so the
    bytes depend only on the span's pairs. What it holds is at most one batch and the block handed in.
    """

    def __init__(self, out_dir: Path, vision: bool = False):
        self.out_dir = out_dir
        self.schema = shard_schema(vision)
        self.vision = vision
        self.shards: list[ShardInfo] = []
        self.pairs = 0
        self._pending: list[PairBlock] = []
        self._pending_rows = 0
        self._writer: pa.ipc.RecordBatchFileWriter | None = None
        self._span = -1
        self._shard_rows = 0
        self._sources: dict[str, int] = {}
        (out_dir / SHARD_DIR).mkdir(parents=True, exist_ok=True)

    def add(self, block: PairBlock, sources: list[str], span: int) -> None:
        """Append `block`, the pairs of rows of `span` (spans arrive in increasing order), and name each pair's
        source; the block's source ids are set here, local to the shard."""
        if span != self._span:
            self._flush()
            self._close_shard()
            self._span = span
        if not len(block):
            return
        block.source_id = np.array([self._sources.setdefault(s, len(self._sources)) for s in sources], np.int32)
        self._pending.append(block)
        self._pending_rows += len(block)
        while rows := self._next_batch(final=False):
            self._write(rows)

    def close(self) -> list[ShardInfo]:
        """Flush and close; return every shard written."""
        self._flush()
        self._close_shard()
        return self.shards

    def _flush(self) -> None:
        while self._pending_rows:
            self._write(self._next_batch(final=True))

    def _next_batch(self, final: bool) -> int:
        """The rows of the next record batch once the pending pairs decide it (a batch ends where it is full, or
        before a pair that would not fit), or at the span's end (`final`); 0 while a later pair may still join it."""
        if not self.vision:
            rows = min(self._pending_rows, RECORD_BATCH_ROWS)
        else:
            sizes = [np.array([sum(map(len, images)) for images in b.image_bytes], np.int64) for b in self._pending]
            rows = batch_rows(np.concatenate(sizes), RECORD_BATCH_IMAGE_BYTES) if sizes else 0
        return rows if final or rows == RECORD_BATCH_ROWS or rows < self._pending_rows else 0

    def _write(self, rows: int) -> None:
        head, tail = PairBlock.concat(self._pending).split(rows)
        self._pending, self._pending_rows = ([tail] if len(tail) else []), self._pending_rows - rows
        if self._writer is None:
            self._open_shard()
        self._writer.write_batch(head.record_batch())
        self.pairs += rows
        self._shard_rows += rows

    def _open_shard(self) -> None:
        self._path = self.out_dir / shard_name(self._span)
        self._sink = pa.OSFile(str(self._path), "wb")
        # No compression: readers memory-map shards zero-copy (compressed IPC decodes per batch per worker).
        self._writer = pa.ipc.new_file(self._sink, self.schema)
        self._first = self.pairs

    def _close_shard(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        self._sink.close()
        with open(self._path, "rb") as f:
            os.fsync(f.fileno())
        rel = self._path.relative_to(self.out_dir).as_posix()
        size, digest = self._path.stat().st_size, file_digest(self._path)
        self.shards.append(ShardInfo(rel, self._shard_rows, size, digest, self._first, list(self._sources), self._span))
        self._writer, self._shard_rows, self._sources = None, 0, {}


def open_shard(path: str | Path) -> pa.Table:
    """Memory-map a shard and return it as a table (zero-copy; the file's footer catches truncation)."""
    return pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()


def read_batches(path: str | Path) -> Iterator[pa.RecordBatch]:
    """A shard's record batches read one at a time into memory (not memory-mapped: a pass over a shard's images
    then holds one batch, which `RECORD_BATCH_IMAGE_BYTES` bounds, instead of mapping the whole file in)."""
    with pa.OSFile(str(path), "rb") as f:
        reader = pa.ipc.open_file(f)
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)


def image_views(column: pa.ListArray) -> list[list[pa.Buffer]]:
    """Each pair's images in a batch's `image_bytes` column, as zero-copy slices of its data buffer (no Python
    bytes are made: hashlib reads the slices as they are)."""
    values = column.values
    offsets = np.frombuffer(values.buffers()[1], np.int64)[values.offset :]
    data = values.buffers()[2] or pa.py_buffer(b"")  # none when every image is empty
    pairs = as_numpy(column.offsets)
    return [
        [data.slice(int(offsets[j]), int(offsets[j + 1] - offsets[j])) for j in range(pairs[k], pairs[k + 1])]
        for k in range(len(column))
    ]
