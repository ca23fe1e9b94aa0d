"""The dataset manifest: what a build made and from what; written last, atomically, and read back validated."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dpo_data.errors import DataError
from dpo_state.digest import DIGEST_PREFIX, sha256_json
from dpo_state.errors import DocumentError
from dpo_state.files import read_document, write_json_atomic

MANIFEST_FORMAT_VERSION = 2
"""2: file digests spelled `sha256:<hex>` (1 wrote bare hex); a version-1 dataset must be rebuilt."""
MANIFEST_NAME = "manifest.json"
REJECTS_NAME = "rejects.jsonl"
MANIFEST_SCHEMA = "dataset-manifest"
PERCENTILES = (50, 90, 99)


def dataset_fingerprint(tokenizer_fingerprint: str, sources: list[dict], shards: list[dict]) -> str:
    """Content identity of a dataset: tokenizer, source names and every shard's hash and rows.

    Paths of inputs and build options are left out: two builds that wrote the same pairs with the
    same tokenizer are the same dataset, wherever their inputs lay.
    """
    return DIGEST_PREFIX + sha256_json(
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
    """Validate and write `manifest.json` atomically (fsync, rename): its presence commits the dataset."""
    write_json_atomic(out_dir / MANIFEST_NAME, manifest, schema=MANIFEST_SCHEMA)


def read_manifest(data_dir: str | Path) -> dict:
    """Read and validate a dataset's manifest; a missing, malformed or foreign one is a named `DataError`."""
    path = Path(data_dir) / MANIFEST_NAME
    if not path.is_file():
        hint = " (a failed build leaves only rejects.jsonl)" if (Path(data_dir) / REJECTS_NAME).exists() else ""
        raise DataError(f"{data_dir}: not a committed dataset, {MANIFEST_NAME} is missing{hint}; run dpo-data build")
    try:
        return read_document(
            path,
            MANIFEST_SCHEMA,
            MANIFEST_FORMAT_VERSION,
            fix="rebuild the dataset with this version (dpo-data build ... --overwrite)",
        )
    except DocumentError as e:
        raise DataError(str(e)) from None
