"""The pairs of a `PairStore`, a record batch at a time, memory-mapped: each part's offsets and ids as numpy views."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from dpo_data.dataset.manifest import read_manifest
from dpo_data.dataset.shards import PARTS, as_numpy
from dpo_data.dataset.store import PairStore
from dpo_data.errors import DataError
from dpo_data.progress import Stage

HEX = np.full(256, 0, np.uint64)
HEX[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint64)


@dataclass(frozen=True)
class IdBatch:
    """Consecutive pairs `first`..`first + rows - 1` (global store indices): per part, int64 offsets (rows + 1) into
    its int32 ids; a vision store's image digests as uint64 (the first 16 hex digits of each sha256) with their
    per-pair offsets, else None."""

    first: int
    rows: int
    parts: dict[str, tuple[np.ndarray, np.ndarray]]
    images: tuple[np.ndarray, np.ndarray] | None


def id_batches(store: PairStore, stage: str | None = None, progress: bool = False) -> Iterator[IdBatch]:
    """Every record batch of `store`'s shards in pair order (the store's), read by memory map; with `stage`, a
    progress line counting pairs."""
    first = 0
    with Stage(stage or "", total=store.num_pairs, enabled=progress and stage is not None, unit="pairs") as shown:
        for directory in store.dirs:
            for shard in read_manifest(directory)["shards"]:
                for batch in _batches(Path(directory) / shard["path"]):
                    yield _id_batch(batch, first, store.vision)
                    first += batch.num_rows
                    shown.advance(batch.num_rows)
    if first != store.num_pairs:
        raise DataError(f"the shards hold {first} pairs, the store {store.num_pairs}; run dpo-data verify")


def _batches(path: Path) -> Iterator[pa.RecordBatch]:
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
        for i in range(reader.num_record_batches):
            yield reader.get_batch(i)
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: cannot read the shard ({e}); run dpo-data verify on its dataset") from None


def _id_batch(batch: pa.RecordBatch, first: int, vision: bool) -> IdBatch:
    parts = {}
    for part in PARTS:
        column = batch.column(f"{part}_ids")
        parts[part] = (as_numpy(column.offsets).astype(np.int64), as_numpy(column.values))
    images = _digests(batch.column("image_sha256")) if vision else None
    return IdBatch(first, batch.num_rows, parts, images)


def _digests(column: pa.ListArray) -> tuple[np.ndarray, np.ndarray]:
    """Each image's sha256 as a uint64 (its first 16 hex digits: 64 bits of a cryptographic digest), and the
    per-pair offsets into them. Vectorised over the strings' bytes: every digest is 64 lowercase hex digits."""
    offsets = as_numpy(column.offsets).astype(np.int64)
    strings = column.values
    count = int(offsets[-1] - offsets[0])
    if not count:
        return offsets, np.zeros(0, np.uint64)
    starts = as_numpy(pa.Array.from_buffers(pa.int32(), len(strings) + 1, [None, strings.buffers()[1]]))
    data = np.frombuffer(strings.buffers()[2], np.uint8)
    picked = starts[offsets[0] : offsets[-1]].astype(np.int64)[:, None] + np.arange(16)
    nibbles = HEX[data[picked]]
    shifts = np.arange(60, -4, -4, dtype=np.uint64)
    return offsets, np.bitwise_or.reduce(nibbles << shifts, axis=1)
