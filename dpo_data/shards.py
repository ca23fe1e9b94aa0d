"""Arrow IPC shards of tokenized pairs: the on-disk schema, a deterministic writer and a memory-mapped reader."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from dpo_state.digest import sha256_file

RECORD_BATCH_ROWS = 1024  # fixed, so batch boundaries (and bytes) never depend on --num-proc
SHARD_DIR = "shards"

SHARD_SCHEMA = pa.schema(
    [
        pa.field("pair_index", pa.int64(), nullable=False),
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
ID_COLUMNS = ("prompt_ids", "chosen_ids", "rejected_ids")


@dataclass(frozen=True)
class ShardRow:
    """One pair as written: ids plus where it came from."""

    pair_index: int
    source_id: int
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    input_index: int
    input_row: int
    row_id: str | None


@dataclass(frozen=True)
class ShardInfo:
    """What the manifest records of a finished shard."""

    path: str
    rows: int
    bytes: int
    sha256: str
    first_pair_index: int


class ShardWriter:
    """Writes pairs in arrival order into shards of at most `pairs_per_shard` rows (uncompressed IPC files)."""

    def __init__(self, out_dir: Path, pairs_per_shard: int):
        self.out_dir = out_dir
        self.pairs_per_shard = pairs_per_shard
        self.shards: list[ShardInfo] = []
        self._rows: list[ShardRow] = []
        self._writer: pa.ipc.RecordBatchFileWriter | None = None
        self._path: Path | None = None
        self._shard_rows = 0
        self._first = 0
        (out_dir / SHARD_DIR).mkdir(parents=True, exist_ok=True)

    def add(self, row: ShardRow) -> None:
        self._rows.append(row)
        if len(self._rows) == RECORD_BATCH_ROWS or self._shard_rows + len(self._rows) == self.pairs_per_shard:
            self._flush()

    def close(self) -> list[ShardInfo]:
        """Flush and close; return every shard written."""
        self._flush()
        self._close_shard()
        return self.shards

    def _flush(self) -> None:
        if not self._rows:
            return
        if self._writer is None:
            self._open_shard(self._rows[0].pair_index)
        self._writer.write_batch(_record_batch(self._rows))
        self._shard_rows += len(self._rows)
        self._rows = []
        if self._shard_rows == self.pairs_per_shard:
            self._close_shard()

    def _open_shard(self, first_pair_index: int) -> None:
        self._path = self.out_dir / SHARD_DIR / f"shard-{len(self.shards):05d}.arrow"
        self._sink = pa.OSFile(str(self._path), "wb")
        # No compression: readers memory-map shards zero-copy (compressed IPC decodes per batch per worker).
        self._writer = pa.ipc.new_file(self._sink, SHARD_SCHEMA)
        self._first = first_pair_index

    def _close_shard(self) -> None:
        if self._writer is None:
            return
        self._writer.close()
        self._sink.close()
        with open(self._path, "rb") as f:
            os.fsync(f.fileno())
        rel = self._path.relative_to(self.out_dir).as_posix()
        self.shards.append(
            ShardInfo(rel, self._shard_rows, self._path.stat().st_size, sha256_file(self._path), self._first)
        )
        self._writer, self._shard_rows = None, 0


def _list_array(seqs: list[list[int]]) -> pa.ListArray:
    lengths = np.fromiter((len(s) for s in seqs), dtype=np.int32, count=len(seqs))
    offsets = np.zeros(len(seqs) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.fromiter((t for s in seqs for t in s), dtype=np.int32, count=int(offsets[-1]))
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))


def _record_batch(rows: list[ShardRow]) -> pa.RecordBatch:
    prompt, chosen, rejected = ([getattr(r, f) for r in rows] for f in ("prompt", "chosen", "rejected"))
    columns = [
        pa.array([r.pair_index for r in rows], pa.int64()),
        pa.array([r.source_id for r in rows], pa.int32()),
        _list_array(prompt),
        _list_array(chosen),
        _list_array(rejected),
        pa.array([len(s) for s in prompt], pa.int32()),
        pa.array([len(s) for s in chosen], pa.int32()),
        pa.array([len(s) for s in rejected], pa.int32()),
        pa.array([r.input_index for r in rows], pa.int32()),
        pa.array([r.input_row for r in rows], pa.int64()),
        pa.array([r.row_id for r in rows], pa.string()),
    ]
    return pa.RecordBatch.from_arrays(columns, schema=SHARD_SCHEMA)


def open_shard(path: str | Path) -> pa.Table:
    """Memory-map a shard and return it as a table (zero-copy; the file's footer catches truncation)."""
    return pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
