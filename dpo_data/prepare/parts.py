"""`dpo-data build --part K/N`: which spans a task builds, the plan all N tasks share, and its record part.json.

Part K of N builds spans K, K + N, K + 2N, ... (a span is `--pairs-per-shard` consecutive rows of the global row
order over every input, so skewed files balance). Its part.json, written last, is its completion marker:
`dpo-data merge` joins parts 0..N-1 of one plan into the dataset a single build would have written.
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from dpo_data import __version__
from dpo_data.dataset.manifest import MANIFEST_NAME, PART_NAME, REJECTS_NAME
from dpo_data.dataset.shards import ShardInfo
from dpo_data.errors import DataError
from dpo_state.digest import DIGEST_PREFIX, file_digest, sha256_json
from dpo_state.errors import DocumentError
from dpo_state.files import read_document, write_json_atomic

PART_FORMAT_VERSION = 1
PART_SCHEMA = "dataset-part"
SLURM_VARIABLES = ("SLURM_ARRAY_TASK_ID", "SLURM_ARRAY_TASK_COUNT", "SLURM_ARRAY_TASK_MIN", "SLURM_ARRAY_TASK_MAX")
MAX_PARTS = 100_000
"""The most parts a build splits into (also the part schema's bound): a part is one task of a job array, and
Slurm's MaxArraySize (1001 by default, 4000001 at most) and every real array sit far below. Beyond it, N is a
typo (`--part 0/1000000000000`), and the merge would name a million missing parts."""
_NUMBER = re.compile(r"[0-9]{1,12}")
"""A part number or Slurm array variable: ASCII digits only (`str.isdigit` accepts '²', which `int` refuses), and
few enough that `int` never meets a huge string; `Part` bounds the value."""


@dataclass(frozen=True)
class Part:
    """Task `index` of `count` (0-based)."""

    index: int
    count: int
    origin: str = "--part"
    """Where it came from, for messages: `--part` or the Slurm array variables."""

    def __post_init__(self):
        if self.count > MAX_PARTS:
            raise DataError(
                f"{self.origin} gives part {self.index}/{self.count}; N is at most {MAX_PARTS} (a part per task of a "
                "job array): give the number of tasks as N, and choose --pairs-per-shard so each gets several spans"
            )
        if self.count < 1 or not 0 <= self.index < self.count:
            raise DataError(
                f"{self.origin} gives part {self.index}/{self.count}; a part is K/N with N >= 1 and K in 0..N-1 "
                "(0-based: the tasks of --part K/8 are K = 0 to 7)"
            )

    @property
    def label(self) -> str:
        return f"{self.index}/{self.count}"

    def owns(self, span: int) -> bool:
        return span % self.count == self.index

    def rows(self, rows_total: int, span_rows: int) -> int:
        """How many of `rows_total` rows (in spans of `span_rows`) this part's spans hold."""
        spans = -(-rows_total // span_rows)
        rows = len(range(self.index, spans, self.count)) * span_rows
        if spans and self.owns(spans - 1):
            rows -= spans * span_rows - rows_total  # the last span is short
        return rows


def parse_part(text: str) -> Part | None:
    """`--part K/N` (or `none`: a whole build, even inside a Slurm array job)."""
    if text.strip().lower() == "none":
        return None
    k, slash, n = (piece.strip() for piece in text.partition("/"))
    if not slash or not _NUMBER.fullmatch(k) or not _NUMBER.fullmatch(n):
        raise DataError(
            f"--part is {_shown(text)}; allowed: K/N with integers 0 <= K < N <= {MAX_PARTS} in ASCII digits "
            "(e.g. --part 3/8), or none for a whole build"
        )
    return Part(int(k), int(n))


def _shown(value: str) -> str:
    """A value for a message, cut: a 10,000-digit --part is named, not printed whole."""
    return repr(value) if len(value) <= 40 else f"{value[:40]!r}... ({len(value)} characters)"


def resolve_part(given: str | None, env: Mapping[str, str] = os.environ) -> Part | None:
    """The part this build makes: `--part` when given, else the Slurm job array task's, else none."""
    if given is not None:
        return parse_part(given)
    if "SLURM_ARRAY_TASK_ID" not in env:
        return None
    values = {}
    for name in SLURM_VARIABLES:
        value = env.get(name, "")
        if not _NUMBER.fullmatch(value):
            raise DataError(
                f"{name} is {_shown(value)} in a Slurm job array task, not a number in ASCII digits; the build "
                f"reads its part from {', '.join(SLURM_VARIABLES)}: pass --part K/N yourself, or --part none for "
                "a whole build"
            )
        values[name] = int(value)
    first, last, count = (
        values["SLURM_ARRAY_TASK_MIN"],
        values["SLURM_ARRAY_TASK_MAX"],
        values["SLURM_ARRAY_TASK_COUNT"],
    )
    if last - first + 1 != count:  # --array=0-15:2 or 1,5,7: task ids are not first..first+count-1
        raise DataError(
            f"the Slurm array runs {count} tasks with ids {first}..{last}, not consecutive; give each task its "
            "part with --part K/N (e.g. --part $((SLURM_ARRAY_TASK_ID / 2))/8), or use --array=0-(N-1)"
        )
    origin = f"SLURM_ARRAY_TASK_ID={values['SLURM_ARRAY_TASK_ID']} of {first}..{last}"
    return Part(values["SLURM_ARRAY_TASK_ID"] - first, count, origin)


def build_plan(
    options: dict, attestation: dict, entries: list[dict], part: Part, processor: dict | None = None
) -> dict:
    """What every part of one build shares: the code, the recorded options, the tokenizer (and a vision build's
    processor), the inputs (paths as given, bytes, sha256) and the number of parts. Parts of different plans never
    merge."""
    keys = ("path", "format", "default_source", "bytes", "sha256")
    plan = {
        "producer": {"name": "dpo-toolkit", "version": __version__},
        "options": options,
        "tokenizer": attestation["fingerprint"],
        "inputs": [{key: e[key] for key in keys} for e in entries],
        "parts": part.count,
    }
    if processor is not None:
        plan["processor"] = processor["fingerprint"]
    return plan


def plan_differences(a: dict, b: dict) -> list[str]:
    """The plan entries that differ, named (options key by key)."""
    found = [
        f"options.{k}"
        for k in sorted(set(a["options"]) | set(b["options"]))
        if a["options"].get(k) != b["options"].get(k)
    ]
    labels = {
        "producer": "producer version",
        "tokenizer": "tokenizer",
        "processor": "processor",
        "inputs": "inputs",
        "parts": "number of parts",
    }
    found += [label for key, label in labels.items() if a.get(key) != b.get(key)]
    return found


def part_document(
    part: Part,
    plan: dict,
    tally,
    shards: list[ShardInfo],
    attestation: dict,
    staging: Path,
    processor: dict | None = None,
) -> dict:
    """part.json: the plan, this part's counts and its shards, everything the merge needs to add it up (a vision
    part's images are counted again from its shards by the merge, which reads them all)."""
    rejects = staging / REJECTS_NAME
    inputs = [
        {**entry, "columns": dict(sorted(seen.items())), "forms": dict(sorted(forms.items()))}
        for entry, seen, forms in zip(tally.inputs, tally.columns, tally.forms)
    ]
    return {
        "format_version": PART_FORMAT_VERSION,
        "kind": "dpo-dataset-part",
        "part": {"index": part.index, "count": part.count},
        "plan": plan,
        "plan_sha256": DIGEST_PREFIX + sha256_json(plan),
        "tokenizer": attestation,
        **({} if processor is None else {"processor": processor}),
        "rows_total": tally.rows_total,
        "inputs": inputs,
        "counts": {
            "pairs": tally.pairs,
            "sources": {name: tally.source_pairs[name] for name in tally.sources},
            "source_rejects": dict(sorted(tally.source_rejects.items())),
            "by_reason": dict(sorted(tally.by_reason.items())),
            "truncated_prompts": tally.truncated_prompts,
            "truncated_prompt_tokens": tally.truncated_prompt_tokens,
            "max_token_id": tally.max_token_id,
        },
        "shards": [
            {"span": s.span, "path": s.path, "rows": s.rows, "bytes": s.bytes, "sha256": s.sha256, "sources": s.sources}
            for s in shards
        ],
        "rejects": {
            "file": REJECTS_NAME,
            "count": int(sum(tally.by_reason.values())),
            "bytes": rejects.stat().st_size,
            "sha256": file_digest(rejects),
        },
    }


def write_part(staging: Path, document: dict) -> None:
    """Validate and write part.json atomically: its presence commits the part."""
    write_json_atomic(staging / PART_NAME, document, schema=PART_SCHEMA)


def read_part(part_dir: str | Path) -> dict:
    """A finished part's part.json, validated; a missing or malformed one is a named `DataError`."""
    path = Path(part_dir) / PART_NAME
    if not path.is_file():
        what = "a dataset, not a part" if (Path(part_dir) / MANIFEST_NAME).is_file() else "not a finished part"
        raise DataError(
            f"{part_dir}: {what} (no {PART_NAME}; a part build that is still running, was killed or was refused "
            "leaves none); build it with dpo-data build ... --part K/N --out " + str(part_dir)
        )
    try:
        document = read_document(path, PART_SCHEMA, PART_FORMAT_VERSION, fix="rebuild this part with this version")
    except DocumentError as e:
        raise DataError(str(e)) from None
    if document["plan_sha256"] != DIGEST_PREFIX + sha256_json(document["plan"]):
        raise DataError(
            f"{path}: plan_sha256 does not match its plan; the file was edited or damaged: rebuild the part"
        )
    index, count = document["part"]["index"], document["part"]["count"]
    if index >= count or count != document["plan"]["parts"]:
        raise DataError(
            f"{path}: part {index}/{count} of a plan of {document['plan']['parts']} parts; a part is K/N with "
            "K < N = the plan's parts: the file was edited or damaged, rebuild the part"
        )
    return document


def existing_part(out: Path) -> dict | None:
    """The part.json `out` holds, or None when it holds none (an unreadable one is an error: never overwritten
    unseen)."""
    return read_part(out) if (out / PART_NAME).is_file() else None


def refused_part(out: Path, found: dict, part: Part, plan: dict) -> DataError:
    """The error for an `out` that holds a finished part of another build (stale: other options, inputs or code)
    or another part of this one."""
    theirs = f"{found['part']['index']}/{found['part']['count']}"
    if found["plan"] != plan:
        why = f"part {theirs} of another build (it differs in: {', '.join(plan_differences(found['plan'], plan))})"
    else:
        why = f"part {theirs} of this build, not part {part.label}"
    return DataError(
        f"--out {out} holds {why}; pass --overwrite to build part {part.label} there, or choose another --out"
    )
