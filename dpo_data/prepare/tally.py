"""What a build counts as it goes, and the one way a count becomes a dataset: refusal checks and the manifest.

A single build fills one `Tally` as its rows stream through; `dpo-data merge` rebuilds the same `Tally` from
its parts' records. Both then call `conclude`, so a merged dataset's manifest is the single build's.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from dpo_data import __version__
from dpo_data.dataset.manifest import (
    MANIFEST_FORMAT_VERSION,
    REJECTS_NAME,
    ImageTally,
    dataset_fingerprint,
    length_histogram,
    length_stats,
    write_manifest,
)
from dpo_data.dataset.shards import ShardInfo
from dpo_data.errors import DataError
from dpo_data.prepare.columns import ignored_columns
from dpo_state.digest import file_digest


@dataclass
class BuildResult:
    """What a finished (or refused) build reports: the manifest when committed, and counts."""

    out: Path
    manifest: dict | None
    rows_read: int
    pairs: int
    rejects_by_reason: dict[str, int]
    seconds: float
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    ignored_columns: dict[str, int] = field(default_factory=dict)
    """Columns no field reads, with the rows (of every input) having them."""
    part: dict | None = None
    """A `--part` build's record (part.json) when it committed one."""
    skipped: bool = False
    """A `--part` build found its part already built with the same plan, and did nothing."""

    @property
    def rejected(self) -> int:
        return sum(self.rejects_by_reason.values())

    @property
    def committed(self) -> bool:
        """A dataset (manifest) or a part (part.json) was written: not refused."""
        return self.manifest is not None or self.part is not None


@dataclass
class Tally:
    """Everything the manifest counts, accumulated in output order."""

    inputs: list[dict]
    columns: list[Counter]
    """Per input: how many rows (objects) have each column."""
    forms: list[Counter]
    """Per input: how many pairs kept came from each row form (`rows.FORMS`)."""
    sources: dict[str, int] = field(default_factory=dict)
    """Source name -> id, in order of first appearance among the pairs kept."""
    source_pairs: Counter = field(default_factory=Counter)
    source_rejects: Counter = field(default_factory=Counter)
    by_reason: Counter = field(default_factory=Counter)
    lengths: list[np.ndarray] = field(default_factory=list)
    pairs: int = 0
    truncated_prompts: int = 0
    truncated_prompt_tokens: int = 0
    max_token_id: int = 0
    rows_total: int = 0
    """Rows in all inputs, this build's or not (a `--part` build reads every row, builds its own)."""
    first_unstable: dict | None = None
    """The first `template_not_prefix_stable` reject, in input order (an override template is refused for it)."""
    images: ImageTally | None = None
    """A vision build's images (None in a text build)."""


def conclude(
    staging: Path,
    tally: Tally,
    shards: list[ShardInfo],
    attestation: dict,
    options: Any,
    template: dict | None,
    processor: dict | None = None,
) -> BuildResult:
    """Check what was counted (a mistyped --columns name is an error; too many rejects a refusal) and, unless
    refused, write the manifest into `staging`. `options` is the build's `BuildOptions`; `processor` a vision
    build's processor attestation."""
    check_mapped_columns(tally, options.columns)
    result = BuildResult(staging, None, tally_rows(tally), tally.pairs, dict(tally.by_reason), 0.0)
    result.ignored_columns = record_ignored_columns(tally, options.columns)
    for entry, forms in zip(tally.inputs, tally.forms):
        entry["forms"] = dict(sorted(forms.items()))
    result.error = refusal(tally, options, template)
    if result.error is None:
        recorded = options.recorded(template, vision=processor is not None)
        manifest = manifest_document(tally, shards, attestation, recorded, staging, processor)
        write_manifest(staging, manifest)
        result.manifest = manifest
        result.prompt_tokens = manifest["totals"]["prompt_tokens"]
        result.completion_tokens = manifest["totals"]["completion_tokens"]
    return result


def tally_rows(tally: Tally) -> int:
    return sum(e["rows_read"] for e in tally.inputs)


def record_ignored_columns(tally: Tally, columns: dict | None) -> dict[str, int]:
    """Each input entry's `ignored_columns`; returns them summed over the inputs."""
    ignored = Counter()
    for entry, seen in zip(tally.inputs, tally.columns):
        entry["ignored_columns"] = ignored_columns(seen, columns)
        ignored.update(entry["ignored_columns"])
    return dict(sorted(ignored.items()))


def check_mapped_columns(tally: Tally, columns: dict | None) -> None:
    """A mapped column that no row of an input has is a mistyped name, not a row problem: a named error."""
    for entry, seen in zip(tally.inputs, tally.columns):
        for field_name, column in (columns or {}).items():
            if column and entry["rows_read"] and not seen[column]:
                have = ", ".join(sorted(seen)[:20]) or "none (no row is an object)"
                raise DataError(
                    f"--columns maps {field_name}={column}, but no row of input {entry['path']} has a column "
                    f"{column!r}; its rows have: {have}. Fix: map {field_name} from one of these columns"
                )


def refusal(tally: Tally, options: Any, template: dict | None) -> str | None:
    """Why these counts must not become a dataset, or None."""
    rows_read = tally_rows(tally)
    if template is not None and tally.first_unstable is not None:
        return unstable_template(tally, options.chat_template)
    if tally.pairs == 0:
        return f"no pair survived: all {rows_read} rows read were rejected" if rows_read else "the inputs hold no rows"
    fraction = (rows_read - tally.pairs) / rows_read
    if options.max_reject_fraction is not None and fraction > options.max_reject_fraction:
        return (
            f"{rows_read - tally.pairs} of {rows_read} rows were rejected ({fraction:.1%}), over "
            f"--max-reject-fraction {options.max_reject_fraction}"
        )
    return None


def unstable_template(tally: Tally, chat_template: Any) -> str:
    """A template the user chose that breaks prefix stability is a bug in the template, not in the rows."""
    first = tally.first_unstable
    locator = "line" if "line" in first else "row"
    where = f"{first['file']} {locator} {first[locator]}"
    return (
        f"--chat-template {chat_template} is not prefix-stable on the data: "
        f"{tally.by_reason['template_not_prefix_stable']} rows were rejected as template_not_prefix_stable, the "
        f"first at {where} ({first['message']}); fix the template so that the prompt rendered with "
        "add_generation_prompt is a prefix of the prompt rendered with its completion (docs/data-build.md)"
    )


def manifest_shards(shards: list[ShardInfo]) -> list[dict]:
    """The manifest's record of each shard (its span is in its name)."""
    keys = ("path", "rows", "bytes", "sha256", "first_pair_index", "sources")
    return [{key: getattr(s, key) for key in keys} for s in shards]


def manifest_document(
    tally: Tally,
    shards: list[ShardInfo],
    attestation: dict,
    options: dict,
    staging: Path,
    processor: dict | None = None,
) -> dict:
    lengths = np.concatenate(tally.lengths).astype(np.int64)
    prompt, chosen, rejected = lengths[:, 0], lengths[:, 1], lengths[:, 2]
    segments = np.concatenate([prompt + chosen, prompt + rejected])
    sources = [{"id": sid, "name": name, "pairs": tally.source_pairs[name]} for name, sid in tally.sources.items()]
    records = manifest_shards(shards)
    rejects_path = staging / REJECTS_NAME
    fingerprint = dataset_fingerprint(
        attestation["fingerprint"],
        sources,
        records,
        options.get("columns"),
        None if processor is None else processor["fingerprint"],
    )
    vision = {} if processor is None else {"processor": processor, "images": tally.images.record()}
    return {
        "format_version": MANIFEST_FORMAT_VERSION,
        "kind": "dpo-dataset",
        "fingerprint": fingerprint,
        "producer": {"name": "dpo-toolkit", "version": __version__, "options": options},
        "tokenizer": attestation,
        **vision,
        "inputs": tally.inputs,
        "sources": sources,
        "shards": records,
        "totals": {
            "rows_read": tally_rows(tally),
            "pairs": tally.pairs,
            "rejected": int(sum(tally.by_reason.values())),
            "prompt_tokens": int(prompt.sum()),
            "chosen_tokens": int(chosen.sum()),
            "rejected_tokens": int(rejected.sum()),
            "completion_tokens": int(chosen.sum() + rejected.sum()),
            "input_tokens": int(segments.sum()),
            "truncated_prompts": tally.truncated_prompts,
            "truncated_prompt_tokens": tally.truncated_prompt_tokens,
            "max_token_id": tally.max_token_id,
        },
        "lengths": {
            "prompt": length_stats(prompt),
            "chosen": length_stats(chosen),
            "rejected": length_stats(rejected),
            "segment": length_stats(segments),
        },
        "length_histogram": length_histogram(segments),
        "rejects": {
            "file": REJECTS_NAME,
            "count": int(sum(tally.by_reason.values())),
            "bytes": rejects_path.stat().st_size,
            "sha256": file_digest(rejects_path),
            "by_reason": dict(sorted(tally.by_reason.items())),
            "by_source": dict(sorted(tally.source_rejects.items())),
        },
    }
