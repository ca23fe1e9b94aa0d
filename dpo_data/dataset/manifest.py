"""The dataset manifest: what a build made and from what; written last, atomically, and read back validated."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpo_data.errors import DataError
from dpo_data.images import DEFAULT_MAX_ROW_IMAGE_PIXELS
from dpo_state.digest import DIGEST_PREFIX, bytes_digest, sha256_json
from dpo_state.errors import DocumentError
from dpo_state.files import read_document, write_json_atomic

MANIFEST_FORMAT_VERSION = 3
"""3: a shard holds the pairs of one span of input rows, with source ids of its own (`shards[].sources`), so a
`--part` build's shards are the single build's; 2 spelled file digests `sha256:<hex>` (1 wrote bare hex). A
dataset of an earlier version must be rebuilt."""
MANIFEST_NAME = "manifest.json"
REJECTS_NAME = "rejects.jsonl"
PART_NAME = "part.json"
"""What a `--part` build commits instead of a manifest (`dpo_data.prepare.parts`): not a dataset until merged."""
STAGING_SUFFIX = r"\.incomplete-[0-9a-f]{12}"
"""How a build or merge names its staging directory beside --out (OUT.incomplete-XXXXXXXXXXXX), as a regex."""
MANIFEST_SCHEMA = "dataset-manifest"
PERCENTILES = (50, 90, 99)


def dataset_fingerprint(
    tokenizer_fingerprint: str,
    sources: list[dict],
    shards: list[dict],
    columns: dict | None = None,
    processor_fingerprint: str | None = None,
    lineage: dict | None = None,
) -> str:
    """Content identity of a dataset: tokenizer, source names, every shard's hash, rows and source names (a vision
    dataset's shards hold its images' bytes, so their hashes cover every image), the column mapping (`--columns`)
    when one was given, a vision dataset's processor fingerprint, and a filtered dataset's lineage (its parent's
    fingerprint and the filter's options: `dpo-data filter`).

    Paths of inputs and the other build options are left out: two builds that wrote the same pairs with the
    same tokenizer are the same dataset, wherever their inputs lay. The mapping, the processor and the lineage enter
    only when present, so a text build keeps the fingerprint it always had.
    """
    content = {
        "format_version": MANIFEST_FORMAT_VERSION,
        "tokenizer": tokenizer_fingerprint,
        "sources": [s["name"] for s in sources],
        "shards": [[s["path"], s["rows"], s["sha256"], s["sources"]] for s in shards],
    }
    if columns:
        content["columns"] = columns
    if processor_fingerprint is not None:
        content["processor"] = processor_fingerprint
    if lineage is not None:
        content["lineage"] = lineage
    return DIGEST_PREFIX + sha256_json(content)


def manifest_fingerprint(m: dict) -> str:
    """`dataset_fingerprint` of a manifest's own content."""
    columns = m["producer"]["options"].get("columns")
    processor = m["processor"]["fingerprint"] if "processor" in m else None
    return dataset_fingerprint(
        m["tokenizer"]["fingerprint"], m["sources"], m["shards"], columns, processor, m.get("lineage")
    )


@dataclass
class ImageTally:
    """A vision dataset's images: how many, their bytes, the pairs having any, the most a pair has."""

    count: int = 0
    bytes: int = 0
    pairs: int = 0
    max_per_pair: int = 0

    def add(self, per_pair: list[int], sizes: list[int]) -> None:
        """Count pairs holding `per_pair` images each, whose images have `sizes` bytes."""
        self.count += sum(per_pair)
        self.bytes += sum(sizes)
        self.pairs += sum(1 for n in per_pair if n)
        self.max_per_pair = max([self.max_per_pair, *per_pair])

    def record(self) -> dict[str, int]:
        """The manifest's `images`."""
        return {"count": self.count, "bytes": self.bytes, "pairs": self.pairs, "max_per_pair": self.max_per_pair}


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


def manifest_problems(m: dict) -> list[str]:
    """Whether a (schema-valid) manifest agrees with itself: its fingerprint recomputed from its content,
    the tokenizer fingerprint from its components, shard rows and offsets, sources and input counts
    against the totals. Files are not read (`dpo-data verify` does that)."""
    from dpo_state.attestation import attestation_problems

    problems = attestation_problems(m["tokenizer"]) + processor_problems(m)
    expected = manifest_fingerprint(m)
    if expected != m["fingerprint"]:
        problems.append(f"fingerprint {m['fingerprint']} does not match its content ({expected})")
    problems += _template_problems(m)
    totals, offset = m["totals"], 0
    for shard in m["shards"]:
        if shard["first_pair_index"] != offset:
            problems.append(
                f"{shard['path']}: first_pair_index {shard['first_pair_index']}, the shards before it "
                f"hold {offset} rows"
            )
        offset += shard["rows"]
    if offset != totals["pairs"]:
        problems.append(f"shards hold {offset} rows, totals.pairs is {totals['pairs']}")
    if sum(s["pairs"] for s in m["sources"]) != totals["pairs"]:
        problems.append("the sources' pairs do not add up to totals.pairs")
    if sorted(s["id"] for s in m["sources"]) != list(range(len(m["sources"]))):
        problems.append("source ids are not 0..N-1")
    appearing = list(dict.fromkeys(name for shard in m["shards"] for name in shard["sources"]))
    if appearing != [s["name"] for s in sorted(m["sources"], key=lambda s: s["id"])]:
        problems.append("the shards' sources, in order of first appearance, are not the sources by id")
    for entry in m["inputs"]:
        if entry["pairs"] + entry["rejected"] != entry["rows_read"]:
            problems.append(f"input {entry['path']}: pairs + rejected != rows_read")
        if "forms" in entry and sum(entry["forms"].values()) != entry["pairs"]:  # a filtered dataset has none
            problems.append(f"input {entry['path']}: its pairs by row form (forms) do not add up to its pairs")
        over = [k for k, n in entry.get("ignored_columns", {}).items() if n > entry["rows_read"]]
        if over:
            problems.append(f"input {entry['path']}: ignored columns {over} counted in more rows than rows_read")
    if totals["pairs"] + totals["rejected"] != totals["rows_read"]:
        problems.append("totals: pairs + rejected != rows_read")
    if totals["completion_tokens"] != totals["chosen_tokens"] + totals["rejected_tokens"]:
        problems.append("totals: completion_tokens != chosen_tokens + rejected_tokens")
    if totals["input_tokens"] != 2 * totals["prompt_tokens"] + totals["completion_tokens"]:
        problems.append("totals: input_tokens != 2 x prompt_tokens + completion_tokens")
    return problems


def processor_problems(m: dict) -> list[str]:
    """A vision manifest's processor attestation, its images and its options against each other: a self-consistent
    attestation of the dataset's own tokenizer, and `images` and `max_image_pixels` present with it, or none."""
    from dpo_state.attestation import processor_attestation_problems

    keys = [k for k in ("processor", "images") if k in m] + (
        ["producer.options.max_image_pixels"] if "max_image_pixels" in m["producer"]["options"] else []
    )
    if not keys:
        if "max_row_image_pixels" in m["producer"]["options"]:
            return ["producer.options.max_row_image_pixels in a dataset without images (processor)"]
        return []
    if len(keys) < 3:
        return [f"{', '.join(keys)} without the rest of processor, images and producer.options.max_image_pixels"]
    problems = processor_attestation_problems(m["processor"])
    if m["processor"]["components"]["tokenizer"] != sha256_json(m["tokenizer"]["fingerprint"]):
        problems.append("processor.components.tokenizer is not the digest of the dataset's tokenizer fingerprint")
    images = m["images"]
    if (
        images["pairs"] > m["totals"]["pairs"]
        or images["count"] < images["pairs"]
        or (images["max_per_pair"] > images["count"])
    ):
        problems.append(f"images {images} cannot hold for {m['totals']['pairs']} pairs")
    return problems


def max_row_image_pixels(m: dict) -> int:
    """The --max-row-image-pixels a vision dataset's rows were built under. A dataset built before the option
    records none and is read under its default: a row of it whose images declare more is refused by name when
    read, never decoded (the bound keeps a loader worker's memory flat whatever a row names)."""
    return m["producer"]["options"].get("max_row_image_pixels", DEFAULT_MAX_ROW_IMAGE_PIXELS)


def is_vision(m: dict) -> bool:
    """Whether a dataset was built with a processor: its shards hold images."""
    return "processor" in m


def recorded_chat_template(m: dict) -> dict | None:
    """The `--chat-template` override a dataset was built with (file, sha256, text), or None."""
    return m["producer"]["options"].get("chat_template")


def template_origin(template: dict | None) -> str:
    """Where a dataset's chat template came from (its `recorded_chat_template`), for messages comparing datasets."""
    if template is None:
        return "its tokenizer's own chat template"
    return f"--chat-template {template['file']} ({template['sha256'][:19]}...)"


def _template_problems(m: dict) -> list[str]:
    """A recorded override template must be the text the tokenizer attestation hashed, and its own sha256."""
    template = recorded_chat_template(m)
    if template is None:
        return []
    problems = []
    if sha256_json(template["text"]) != m["tokenizer"]["components"]["chat_template"]:
        problems.append("producer.options.chat_template.text is not the chat template the tokenizer attestation hashed")
    if bytes_digest(template["text"].encode("utf-8")) != template["sha256"]:
        problems.append("producer.options.chat_template.sha256 is not the digest of its text")
    return problems


def read_manifest(data_dir: str | Path, consistent: bool = True) -> dict:
    """Read and validate a dataset's manifest; a missing, malformed, foreign or (with `consistent`)
    self-contradicting one is a named `DataError`."""
    path = Path(data_dir) / MANIFEST_NAME
    if not path.is_file():
        if (Path(data_dir) / PART_NAME).is_file():
            raise DataError(
                f"{data_dir}: a part of a dpo-data build --part K/N, not a dataset; join all its parts into one "
                "with dpo-data merge PART_DIR... --out DIR, and use DIR"
            )
        hint = " (a failed build leaves only rejects.jsonl)" if (Path(data_dir) / REJECTS_NAME).exists() else ""
        raise DataError(f"{data_dir}: not a committed dataset, {MANIFEST_NAME} is missing{hint}; run dpo-data build")
    try:
        manifest = read_document(
            path,
            MANIFEST_SCHEMA,
            MANIFEST_FORMAT_VERSION,
            fix="rebuild the dataset with this version (dpo-data build ... --overwrite)",
        )
    except DocumentError as e:
        raise DataError(str(e)) from None
    problems = manifest_problems(manifest) if consistent else []
    if problems:
        raise DataError(
            f"{path} contradicts itself; it was edited or damaged:\n  - "
            + "\n  - ".join(problems)
            + "\n  fix: rebuild the dataset (dpo-data build ... --overwrite); dpo-data verify lists "
            "every problem"
        )
    return manifest
