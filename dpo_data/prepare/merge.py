"""`dpo-data merge`: parts 0..N-1 of one `--part` build -> the dataset the single build writes, shards hard-linked.

The parts are checked first (all present, once each, one plan, this code), their shards hard-linked into a
staging directory and hashed there (so a part rebuilt meanwhile cannot slip in), their rejects merged in input
order, their counts added into the single build's `Tally`; `conclude` then writes the manifest, and the staging
directory is swapped into place as a build's is.
"""

from __future__ import annotations

import errno
import heapq
import os
import sys
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa

from dpo_data import __version__
from dpo_data.dataset.manifest import REJECTS_NAME
from dpo_data.dataset.shards import SHARD_DIR, ShardInfo
from dpo_data.errors import DataError
from dpo_data.prepare.output import OutputLock, check_inputs_outside, commit_staged
from dpo_data.prepare.parts import plan_differences, read_part
from dpo_data.prepare.tally import BuildResult, Tally, conclude
from dpo_data.progress import Stage
from dpo_state.files import file_problems


def merge(part_dirs: list[str | Path], out: str | Path, overwrite: bool = False, progress: bool = False) -> BuildResult:
    """Join the parts at `part_dirs` (any order) into the dataset at `out`; see docs/data-build.md."""
    started = time.perf_counter()
    out = Path(out)
    parts = _check_parts([Path(d) for d in part_dirs])
    check_inputs_outside(out, [str(d) for d, _ in parts])
    with OutputLock(out):
        result = commit_staged(out, overwrite, lambda staging: _merge_into(staging, parts, progress))
    result.seconds = time.perf_counter() - started
    return result


def _check_parts(dirs: list[Path]) -> list[tuple[Path, dict]]:
    """The parts in index order, after every check that needs no shard read."""
    if not dirs:
        raise DataError("no PART_DIR given; pass the directories of parts 0..N-1 of one dpo-data build --part K/N")
    found = [(d, read_part(d)) for d in _without_leftovers(dirs)]
    first_dir, first = found[0]
    for d, doc in found[1:]:
        if doc["plan"] != first["plan"]:
            raise DataError(
                f"part {d} is part of another build than part {first_dir} (they differ in: "
                f"{', '.join(plan_differences(first['plan'], doc['plan']))}); merge only the parts of one build, "
                "or rebuild the odd one with the same inputs, tokenizer and options"
            )
    version = first["plan"]["producer"]["version"]
    if version != __version__:
        raise DataError(
            f"the parts were built by dpo-toolkit {version}, this is {__version__}; merge them with {version}, or "
            "rebuild every part with this version"
        )
    count, by_index = first["part"]["count"], {}
    for d, doc in found:
        index = doc["part"]["index"]
        if index in by_index:
            raise DataError(f"part {index}/{count} is given twice: {by_index[index][0]} and {d}; give each part once")
        by_index[index] = (d, doc)
    missing = [f"{k}/{count}" for k in range(count) if k not in by_index]
    if missing:
        raise DataError(
            f"parts {', '.join(missing)} of {count} are missing (given: {len(found)}); build each with dpo-data "
            "build ... --part K/N, then merge all of them"
        )
    ordered = [by_index[k] for k in range(count)]
    totals = {doc["rows_total"] for _, doc in ordered}
    rows = sum(e["rows_read"] for _, doc in ordered for e in doc["inputs"])
    if len(totals) != 1 or rows != totals.pop():
        raise DataError(
            f"the parts' rows do not add up: they read {sorted({doc['rows_total'] for _, doc in ordered})} rows in "
            f"all and built {rows}; a part.json was edited or damaged: rebuild the parts"
        )
    return ordered


def _without_leftovers(dirs: list[Path]) -> list[Path]:
    """The given paths less a given part's lock file (`P.lock`) and a killed attempt's staging directory
    (`P.incomplete-*`), which a glob such as `parts/part-*` picks up beside the parts; each is named."""
    given = {d.name for d in dirs}
    kept = []
    for d in dirs:
        stem, dot, rest = d.name.partition(".")
        if dot and stem in given and (rest == "lock" or rest.startswith("incomplete-")):
            print(
                f"merge: skipping {d} (the lock or a leftover of part directory {d.with_name(stem)})", file=sys.stderr
            )
        else:
            kept.append(d)
    return kept


def _merge_into(staging: Path, parts: list[tuple[Path, dict]], progress: bool) -> BuildResult:
    first = parts[0][1]
    tally = _tally(parts)
    shards = _link_shards(staging, parts, tally, progress)
    _merge_rejects(staging, parts)
    options, template = _options(first["plan"]["options"])
    return conclude(staging, tally, shards, first["tokenizer"], options, template)


def _tally(parts: list[tuple[Path, dict]]) -> Tally:
    """The parts' counts added up: what the single build counted (lengths and sources come with the shards)."""
    docs = [doc for _, doc in parts]
    keys = ("path", "format", "default_source", "bytes", "sha256")
    inputs = [{k: entry[k] for k in keys} | {"rows_read": 0, "pairs": 0, "rejected": 0} for entry in docs[0]["inputs"]]
    tally = Tally(inputs=inputs, columns=[Counter() for _ in inputs])
    for doc in docs:
        for entry, seen, theirs in zip(tally.inputs, tally.columns, doc["inputs"]):
            for key in ("rows_read", "pairs", "rejected"):
                entry[key] += theirs[key]
            seen.update(theirs["columns"])
        counts = doc["counts"]
        tally.source_pairs.update(counts["sources"])
        tally.source_rejects.update(counts["source_rejects"])
        tally.by_reason.update(counts["by_reason"])
        tally.truncated_prompts += counts["truncated_prompts"]
        tally.truncated_prompt_tokens += counts["truncated_prompt_tokens"]
        tally.max_token_id = max(tally.max_token_id, counts["max_token_id"])
        tally.rows_total = doc["rows_total"]
    return tally


def _link_shards(staging: Path, parts: list[tuple[Path, dict]], tally: Tally, progress: bool) -> list[ShardInfo]:
    """Hard-link every part's shards into `staging` in span order, then hash the links against their part.json;
    adds their pairs, lengths and sources (in order of first appearance) to `tally`."""
    listed = sorted(((s, d, doc["part"]) for d, doc in parts for s in doc["shards"]), key=lambda x: x[0]["span"])
    (staging / SHARD_DIR).mkdir()
    shards = []
    with Stage("merge: hashing the linked shards", total=len(listed), enabled=progress, unit="shards") as stage:
        for shard, part_dir, part in listed:
            if shard["span"] % part["count"] != part["index"]:
                raise DataError(
                    f"{part_dir}/part.json lists span {shard['span']}, which is not part {part['index']}/"
                    f"{part['count']}'s; the file was edited or damaged: rebuild that part"
                )
            target = staging / shard["path"]
            _link(part_dir / shard["path"], target)
            problems = file_problems(
                target, shard["bytes"], shard["sha256"], f"{part_dir}/{shard['path']}", "its part.json"
            )
            if problems:
                raise DataError(f"{problems[0]}; rebuild that part (dpo-data build ... --part K/N --overwrite)")
            lengths = _lengths(target)
            if len(lengths) != shard["rows"]:
                raise DataError(
                    f"{part_dir}/{shard['path']} holds {len(lengths)} pairs, its part.json says {shard['rows']}; "
                    "the part.json was edited or damaged: rebuild that part"
                )
            tally.lengths.append(lengths)
            for name in shard["sources"]:
                tally.sources.setdefault(name, len(tally.sources))
            shards.append(
                ShardInfo(
                    shard["path"],
                    shard["rows"],
                    shard["bytes"],
                    shard["sha256"],
                    tally.pairs,
                    shard["sources"],
                    shard["span"],
                )
            )
            tally.pairs += shard["rows"]
            stage.advance()
    return shards


def _link(source: Path, target: Path) -> None:
    try:
        os.link(source, target)
    except OSError as e:
        if e.errno == errno.ENOENT:
            raise DataError(f"{source}: missing, though its part.json lists it; rebuild that part") from None
        raise DataError(
            f"cannot hard-link {source} into {target.parent} ({e.strerror}); the merge links shards, never copies "
            "them: put --out on the filesystem of the parts"
            + (" (they are on another one)" if e.errno == errno.EXDEV else "")
        ) from None


def _lengths(path: Path) -> np.ndarray:
    """A shard's [prompt, chosen, rejected] lengths per pair, read from its columns (memory-mapped)."""
    try:
        table = pa.ipc.open_file(pa.memory_map(str(path), "r")).read_all()
        return np.stack([table.column(c).to_numpy() for c in ("prompt_len", "chosen_len", "rejected_len")], axis=1)
    except (pa.ArrowException, KeyError) as e:
        raise DataError(f"{path}: not a readable shard ({e}); rebuild that part") from None


def _merge_rejects(staging: Path, parts: list[tuple[Path, dict]]) -> None:
    """One rejects.jsonl in input order: each part's is in input order, so a k-way merge by (input, row)."""
    first = parts[0][1]
    index = {entry["path"]: i for i, entry in enumerate(first["inputs"])}
    files = []
    try:
        for part_dir, doc in parts:
            path = part_dir / REJECTS_NAME
            problems = file_problems(
                path, doc["rejects"]["bytes"], doc["rejects"]["sha256"], str(path), "its part.json"
            )
            if problems:
                raise DataError(f"{problems[0]}; rebuild that part (dpo-data build ... --part K/N --overwrite)")
            files.append(open(path, "rb"))
        with open(staging / REJECTS_NAME, "wb") as merged:
            ordered = heapq.merge(*(_keyed(f, index) for f in files), key=lambda item: item[0])
            merged.writelines(line for _, line in ordered)
    finally:
        for f in files:
            f.close()


def _keyed(lines: Iterator[bytes], index: dict[str, int]) -> Iterator[tuple[tuple[int, int], bytes]]:
    for line in lines:
        record = orjson.loads(line)
        yield (index[record["file"]], record.get("line", record.get("row"))), line


def _options(recorded: dict) -> tuple:
    """The `BuildOptions` the parts were built with (for the refusal checks), and the recorded override template."""
    from dpo_data.prepare.build import BuildOptions

    template = recorded.get("chat_template")
    given = {k: v for k, v in recorded.items() if k != "chat_template"}
    options = BuildOptions(**given, chat_template=None if template is None else template["file"])
    return options, template
