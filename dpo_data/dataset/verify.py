"""What a built dataset holds (`dpo-data inspect`) and whether it is intact (`dpo-data verify`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pyarrow as pa

from dpo_data.dataset.manifest import MANIFEST_NAME, dataset_fingerprint, read_manifest
from dpo_data.dataset.shards import SHARD_SCHEMA, open_shard
from dpo_data.errors import DataError
from dpo_state.files import file_problems


def inspect_dataset(data_dir: str | Path) -> dict[str, Any]:
    """A summary of a dataset read from its manifest alone (no shard is opened)."""
    m = read_manifest(data_dir)
    totals = m["totals"]
    return {
        "path": str(data_dir),
        "fingerprint": m["fingerprint"],
        "tokenizer_fingerprint": m["tokenizer"]["fingerprint"],
        "producer": m["producer"],
        "pairs": totals["pairs"],
        "rows_read": totals["rows_read"],
        "rejected": totals["rejected"],
        "tokens": {k: totals[k] for k in ("prompt_tokens", "chosen_tokens", "rejected_tokens", "input_tokens")},
        "truncated_prompts": totals["truncated_prompts"],
        "sources": m["sources"],
        "lengths": m["lengths"],
        "rejects_by_reason": m["rejects"]["by_reason"],
        "shards": len(m["shards"]),
    }


def format_inspection(info: dict[str, Any]) -> str:
    """The human-readable form of `inspect_dataset`."""
    t = info["tokens"]
    lines = [
        f"dataset      {info['path']}",
        f"fingerprint  {info['fingerprint']}",
        f"tokenizer    {info['tokenizer_fingerprint']}",
        f"pairs        {info['pairs']} kept of {info['rows_read']} rows read ({info['rejected']} rejected)",
        f"tokens       prompt {t['prompt_tokens']}, chosen {t['chosen_tokens']}, rejected {t['rejected_tokens']}, "
        f"input (both segments) {t['input_tokens']}",
        f"shards       {info['shards']}",
        "sources",
        *(f"  {s['id']:>3}  {s['name']:<32} {s['pairs']} pairs" for s in info["sources"]),
        "lengths      min    p50    p90    p99    max   mean",
        *(
            f"  {name:<10} {s['min']:>5} {s['p50']:>6} {s['p90']:>6} {s['p99']:>6} {s['max']:>6} {s['mean']:>6.1f}"
            for name, s in info["lengths"].items()
        ),
        "rejects by reason" + ("" if info["rejects_by_reason"] else ": none"),
        *(f"  {reason:<28} {n}" for reason, n in info["rejects_by_reason"].items()),
    ]
    if info["truncated_prompts"]:
        lines.insert(
            5,
            f"truncated    {info['truncated_prompts']} prompts lost their oldest tokens (--overlength truncate-prompt)",
        )
    return "\n".join(lines)


def verify_dataset(data_dir: str | Path, tokenizer_dir: str | None = None) -> list[str]:
    """Every failure found: schema, shard bytes/sha256/rows/schema, rejects file, counts, fingerprint,
    and with `tokenizer_dir` the tokenizer attestation. An empty list means the dataset is intact."""
    root = Path(data_dir)
    try:
        m = read_manifest(root)
    except DataError as e:
        return [str(e)]
    failures = []
    for shard in m["shards"]:
        failures += _check_shard(root, shard)
    rejects = m["rejects"]
    failures += file_problems(
        root / rejects["file"], rejects["bytes"], rejects["sha256"], rejects["file"], "the manifest"
    )
    failures += _check_counts(root, m)
    expected = dataset_fingerprint(m["tokenizer"]["fingerprint"], m["sources"], m["shards"])
    if expected != m["fingerprint"]:
        failures.append(f"{MANIFEST_NAME}: fingerprint {m['fingerprint']} does not match its content ({expected})")
    if tokenizer_dir is not None:
        failures += _check_tokenizer(m, tokenizer_dir)
    return failures


def _check_shard(root: Path, shard: dict) -> list[str]:
    failures = file_problems(root / shard["path"], shard["bytes"], shard["sha256"], shard["path"], "the manifest")
    if failures and "missing" in failures[0]:
        return failures
    try:
        table = open_shard(root / shard["path"])
    except (pa.ArrowInvalid, OSError) as e:
        return failures + [f"{shard['path']}: not a readable Arrow IPC file ({e})"]
    if table.schema != SHARD_SCHEMA:
        failures.append(f"{shard['path']}: columns {table.schema.names} differ from the shard schema")
    if table.num_rows != shard["rows"]:
        failures.append(f"{shard['path']}: {table.num_rows} rows, manifest says {shard['rows']}")
    return failures


def _check_counts(root: Path, m: dict) -> list[str]:
    failures = []
    totals = m["totals"]
    shard_rows = sum(s["rows"] for s in m["shards"])
    if shard_rows != totals["pairs"]:
        failures.append(f"shards hold {shard_rows} rows, totals.pairs is {totals['pairs']}")
    if sum(s["pairs"] for s in m["sources"]) != totals["pairs"]:
        failures.append("the sources' pairs do not add up to totals.pairs")
    for entry in m["inputs"]:
        if entry["pairs"] + entry["rejected"] != entry["rows_read"]:
            failures.append(f"input {entry['path']}: pairs + rejected != rows_read")
    if totals["pairs"] + totals["rejected"] != totals["rows_read"]:
        failures.append("totals: pairs + rejected != rows_read")
    rejects = root / m["rejects"]["file"]
    if rejects.is_file():
        with open(rejects, "rb") as f:
            lines = sum(1 for _ in f)
        if lines != m["rejects"]["count"]:
            failures.append(f"{m['rejects']['file']}: {lines} records, manifest says {m['rejects']['count']}")
    return failures


def _check_tokenizer(m: dict, tokenizer_dir: str) -> list[str]:
    from transformers import AutoTokenizer

    from dpo_state.attestation import attestation_mismatch, tokenizer_attestation

    try:
        tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as e:
        return [f"--tokenizer {tokenizer_dir}: cannot load a tokenizer ({e})"]
    mismatch = attestation_mismatch(
        m["tokenizer"], tokenizer_attestation(tokenizer), f"tokenizer {tokenizer_dir}", "the dataset"
    )
    if mismatch is None:
        return []
    return [f"{mismatch}; rebuild the dataset with this tokenizer or use the one it was built with"]
