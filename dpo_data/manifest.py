"""The dataset manifest: what a build made and from what; written last, atomically, and read back validated."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from dpo_data.errors import DataError
from dpo_state.digest import sha256_json
from dpo_state.schema import SchemaError, validate

MANIFEST_FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
REJECTS_NAME = "rejects.jsonl"
MANIFEST_SCHEMA = "dataset-manifest"
PERCENTILES = (50, 90, 99)


def dataset_fingerprint(tokenizer_fingerprint: str, sources: list[dict], shards: list[dict]) -> str:
    """Content identity of a dataset: tokenizer, source names and every shard's hash and rows.

    Paths of inputs and build options are left out: two builds that wrote the same pairs with the
    same tokenizer are the same dataset, wherever their inputs lay.
    """
    return "sha256:" + sha256_json(
        {
            "format_version": MANIFEST_FORMAT_VERSION,
            "tokenizer": tokenizer_fingerprint,
            "sources": [s["name"] for s in sources],
            "shards": [[s["path"], s["rows"], s["sha256"]] for s in shards],
        }
    )


def length_stats(lengths: np.ndarray) -> dict[str, Any]:
    """min, mean, p50/p90/p99 and max of a length array (zeros when empty)."""
    if lengths.size == 0:
        return {"min": 0, "mean": 0.0, **{f"p{q}": 0 for q in PERCENTILES}, "max": 0}
    stats = {"min": int(lengths.min()), "mean": round(float(lengths.mean()), 3)}
    for q in PERCENTILES:
        stats[f"p{q}"] = int(np.percentile(lengths, q, method="higher"))
    stats["max"] = int(lengths.max())
    return stats


def length_histogram(segment_lengths: np.ndarray) -> dict[str, Any]:
    """Counts of segment lengths in power-of-two bins [edge_i, edge_i+1)."""
    top = int(segment_lengths.max()) if segment_lengths.size else 1
    edges = [1]
    while edges[-1] <= top:
        edges.append(edges[-1] * 2)
    counts, _ = np.histogram(segment_lengths, bins=edges)
    return {"unit": "tokens per segment (prompt + completion)", "bin_edges": edges, "counts": counts.tolist()}


def write_manifest(out_dir: Path, manifest: dict) -> None:
    """Validate and write `manifest.json` by temporary file + fsync + rename: its presence commits the dataset."""
    validate(MANIFEST_SCHEMA, manifest, "the dataset manifest")
    tmp = out_dir / f".{MANIFEST_NAME}.tmp"
    with open(tmp, "wb") as f:
        f.write(orjson.dumps(manifest, option=orjson.OPT_INDENT_2) + b"\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, out_dir / MANIFEST_NAME)
    fsync_dir(out_dir)


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


MAX_MANIFEST_BYTES = 64 << 20


def read_manifest(data_dir: str | Path) -> dict:
    """Read and validate a dataset's manifest; a missing, malformed or foreign one is a named `DataError`."""
    path = Path(data_dir) / MANIFEST_NAME
    if not path.is_file():
        hint = " (a failed build leaves only rejects.jsonl)" if (Path(data_dir) / REJECTS_NAME).exists() else ""
        raise DataError(f"{data_dir}: not a committed dataset, {MANIFEST_NAME} is missing{hint}; run dpo-data build")
    if path.stat().st_size > MAX_MANIFEST_BYTES:
        raise DataError(f"{path}: {path.stat().st_size} bytes, larger than any manifest ({MAX_MANIFEST_BYTES}); refusing to parse")
    try:
        manifest = orjson.loads(path.read_bytes())
    except orjson.JSONDecodeError as e:
        raise DataError(f"{path}: not valid JSON ({e})") from None
    version = manifest.get("format_version") if isinstance(manifest, dict) else None
    if version != MANIFEST_FORMAT_VERSION:
        raise DataError(
            f"{path}: format_version is {version!r}; this version of dpo-data reads format_version "
            f"{MANIFEST_FORMAT_VERSION}. Fix: rebuild the dataset with this version"
        )
    try:
        validate(MANIFEST_SCHEMA, manifest, str(path))
    except SchemaError as e:
        raise DataError(str(e)) from None
    return manifest
