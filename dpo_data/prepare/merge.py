"""`dpo-data merge`: parts 0..N-1 of one `--part` build -> the dataset the single build writes, shards hard-linked.

The parts are checked first (all present, once each, one plan, this code, their spans their own), their shards
hard-linked into a staging directory and hashed and read there (so a part rebuilt meanwhile cannot slip in), their
rejects merged in input order, every count of each part.json held against what its shards and rejects hold
(`Recount`), then added into the single build's `Tally`; `conclude` then writes the manifest, and the staging
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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from dpo_data import __version__
from dpo_data.dataset.manifest import PART_NAME, REJECTS_NAME, ImageTally
from dpo_data.dataset.shards import PARTS, SHARD_DIR, ShardInfo, as_numpy, open_shard, shard_name
from dpo_data.dataset.verify import reject_record, truncation_problems
from dpo_data.errors import DataError
from dpo_data.prepare.output import OutputLock, check_inputs_outside, commit_staged
from dpo_data.prepare.parts import Part, plan_differences, read_part
from dpo_data.prepare.tally import BuildResult, Tally, conclude
from dpo_data.progress import Stage
from dpo_state.files import file_problems


def merge(part_dirs: list[str | Path], out: str | Path, overwrite: bool = False, progress: bool = False) -> BuildResult:
    """Join the parts at `part_dirs` (any order) into the dataset at `out`; see docs/data-build.md."""
    started = time.perf_counter()
    out = Path(out)
    parts = _check_parts([Path(d) for d in part_dirs])
    check_inputs_outside(out, [str(d) for d, _ in parts])
    _check_out_outside_parts(out, [d for d, _ in parts])
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
    if len(by_index) < count:
        raise DataError(
            f"parts {_missing(by_index, count)} of {count} are missing (given: {len(found)}); build each with "
            "dpo-data build ... --part K/N, then merge all of them"
        )
    ordered = [by_index[k] for k in range(count)]
    for d, doc in ordered:
        _check_listing(d, doc)
        _check_processor(d, doc)
    totals = {doc["rows_total"] for _, doc in ordered}
    rows = sum(e["rows_read"] for _, doc in ordered for e in doc["inputs"])
    if len(totals) != 1 or rows != totals.pop():
        raise DataError(
            f"the parts' rows do not add up: they read {sorted({doc['rows_total'] for _, doc in ordered})} rows in "
            f"all and built {rows}; a part.json was edited or damaged: rebuild the parts"
        )
    return ordered


def _missing(present: dict[int, object], count: int, shown: int = 10) -> str:
    """The parts of 0..count-1 not `present`, as runs ("1/16 to 7/16, 12/16"): a message of a few runs, whatever
    the count."""
    runs, start = [], None
    for k in range(count + 1):
        if k < count and k not in present:
            start = k if start is None else start
        elif start is not None:
            runs.append(f"{start}/{count}" + ("" if start == k - 1 else f" to {k - 1}/{count}"))
            start = None
    return ", ".join(runs[:shown]) + (f" and {len(runs) - shown} more runs" if len(runs) > shown else "")


def _check_listing(part_dir: Path, doc: dict) -> None:
    """A part.json lists its inputs as its plan does, and its shards in ascending span order, each a span the part
    owns within the rows read, named for its span: the merged pair order is the span order, so a swapped or
    foreign span would reorder the dataset."""
    keys = ("path", "format", "default_source", "bytes", "sha256")
    if [{k: entry[k] for k in keys} for entry in doc["inputs"]] != doc["plan"]["inputs"]:
        raise _edited(part_dir, doc, "lists inputs that are not its plan's (path, format, source, bytes, sha256)")
    part, span_rows = _part(doc), doc["plan"]["options"]["pairs_per_shard"]
    spans, previous = -(-doc["rows_total"] // span_rows), -1
    for shard in doc["shards"]:
        span = shard["span"]
        if not part.owns(span):
            raise _edited(part_dir, doc, f"lists span {span}, which is not part {part.label}'s")
        if span <= previous:
            raise _edited(part_dir, doc, f"lists span {span} after span {previous}; a part's spans ascend")
        if span >= spans:
            raise _edited(part_dir, doc, f"lists span {span}, but {doc['rows_total']} rows make spans 0..{spans - 1}")
        if shard["path"] != shard_name(span):
            raise _edited(part_dir, doc, f"lists span {span} as {shard['path']}, not {shard_name(span)}")
        previous = span


def _check_processor(part_dir: Path, doc: dict) -> None:
    """A vision part's processor attestation is its plan's, and self-consistent (the manifest will record it)."""
    from dpo_state.attestation import processor_attestation_problems

    recorded, planned = doc.get("processor"), doc["plan"].get("processor")
    if recorded is None and planned is None:
        return
    if recorded is None or planned != recorded["fingerprint"] or processor_attestation_problems(recorded):
        raise _edited(part_dir, doc, "records a processor attestation that is not its plan's processor")


def _part(doc: dict) -> Part:
    return Part(doc["part"]["index"], doc["part"]["count"])


def _edited(part_dir: Path, doc: dict, problem: str) -> DataError:
    """A part.json that contradicts its part's own files: it was edited or damaged."""
    label = _part(doc).label
    return DataError(
        f"part {label} ({part_dir}): its {PART_NAME} {problem}; the file was edited or damaged: rebuild that part "
        f"(dpo-data build ... --part {label} --overwrite)"
    )


def _check_out_outside_parts(out: Path, part_dirs: list[Path]) -> None:
    """The parts may be deleted once merged (the dataset holds its own links): a dataset inside one would go too."""
    root = out.resolve()
    for part_dir in part_dirs:
        resolved = part_dir.resolve()
        if root == resolved or resolved in root.parents:
            raise DataError(
                f"--out {out} lies inside the part directory {part_dir}; deleting the parts after the merge would "
                "delete the dataset: choose an --out outside every part"
            )


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
    recounts = [Recount(len(doc["inputs"])) for _, doc in parts]
    shards = _link_shards(staging, parts, tally, recounts, progress)
    _merge_rejects(staging, parts, recounts)
    for (part_dir, doc), recount in zip(parts, recounts):
        _check_counts(part_dir, doc, recount)
    options, template = _options(first["plan"]["options"])
    return conclude(staging, tally, shards, first["tokenizer"], options, template, first.get("processor"))


@dataclass
class Recount:
    """One part's counts, recomputed from its shards and its rejects file, to hold its part.json against: a
    count the merge adds up unchecked would be a silently wrong manifest."""

    inputs: int
    pairs: int = 0
    sources: Counter = field(default_factory=Counter)
    max_token_id: int = 0
    lengths: list[np.ndarray] = field(default_factory=list)
    input_pairs: Counter = field(default_factory=Counter)
    rejects: int = 0
    by_reason: Counter = field(default_factory=Counter)
    source_rejects: Counter = field(default_factory=Counter)
    input_rejects: Counter = field(default_factory=Counter)

    def add_shard(self, shard: dict, table: pa.Table, lengths: np.ndarray) -> None:
        self.pairs += table.num_rows
        local = as_numpy(table.column("source_id"))
        self.sources.update({shard["sources"][k]: int(n) for k, n in enumerate(np.bincount(local)) if n})
        self.input_pairs.update(
            {i: int(n) for i, n in enumerate(np.bincount(as_numpy(table.column("input_index")))) if n}
        )
        self.max_token_id = max(self.max_token_id, _max_token_id(table))
        self.lengths.append(lengths)

    def add_reject(self, record: dict, input_index: int) -> None:
        self.rejects += 1
        self.by_reason[record["reason"]] += 1
        self.source_rejects[record["source"]] += 1
        self.input_rejects[input_index] += 1


def _check_counts(part_dir: Path, doc: dict, recount: Recount) -> None:
    """Refuse a part whose part.json states a count its shards and rejects do not give, naming the first."""
    counts = doc["counts"]
    stated = [
        ("counts.pairs", counts["pairs"], recount.pairs),
        ("counts.sources", counts["sources"], dict(recount.sources)),
        ("counts.max_token_id", counts["max_token_id"], recount.max_token_id),
        ("counts.by_reason", counts["by_reason"], dict(recount.by_reason)),
        ("counts.source_rejects", counts["source_rejects"], dict(recount.source_rejects)),
        ("rejects.count", doc["rejects"]["count"], recount.rejects),
    ]
    for i, entry in enumerate(doc["inputs"]):
        pairs, rejected = recount.input_pairs[i], recount.input_rejects[i]
        stated += [(f"inputs[{i}].{key}", entry[key], n) for key, n in (("pairs", pairs), ("rejected", rejected))]
        stated.append((f"inputs[{i}].rows_read", entry["rows_read"], pairs + rejected))
        stated.append((f"inputs[{i}].forms (pairs by row form, added up)", sum(entry["forms"].values()), pairs))
    problems = [
        f"says {key} is {_sorted(said)}, its shards and rejects give {_sorted(got)}"
        for key, said, got in stated
        if said != got
    ]
    rows = _part(doc).rows(doc["rows_total"], doc["plan"]["options"]["pairs_per_shard"])
    read = recount.pairs + recount.rejects
    if rows != read:
        problems.append(
            f"says rows_total is {doc['rows_total']}, so its spans hold {rows} rows, its shards and rejects hold {read}"
        )
    lengths = np.concatenate(recount.lengths) if recount.lengths else np.zeros((0, 3), np.int64)
    problems += [
        f"says {problem}"
        for problem in truncation_problems(
            counts["truncated_prompts"], counts["truncated_prompt_tokens"], lengths, doc["plan"]["options"], "counts."
        )
    ]
    problems += [
        f"says inputs[{i}].columns.{name} is {n}, more than its {entry['rows_read']} rows of that input"
        for i, entry in enumerate(doc["inputs"])
        for name, n in entry["columns"].items()
        if n > entry["rows_read"]
    ]
    if problems:
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise _edited(part_dir, doc, problems[0] + more)


def _sorted(value):
    """A count by name, by name (as the manifest writes it), so two can be compared by eye."""
    return dict(sorted(value.items())) if isinstance(value, dict) else value


def _tally(parts: list[tuple[Path, dict]]) -> Tally:
    """The parts' counts added up: what the single build counted (lengths and sources come with the shards)."""
    docs = [doc for _, doc in parts]
    keys = ("path", "format", "default_source", "bytes", "sha256")
    inputs = [{k: entry[k] for k in keys} | {"rows_read": 0, "pairs": 0, "rejected": 0} for entry in docs[0]["inputs"]]
    tally = Tally(inputs=inputs, columns=[Counter() for _ in inputs], forms=[Counter() for _ in inputs])
    tally.images = ImageTally() if "processor" in docs[0]["plan"] else None  # counted from the shards as linked
    for doc in docs:
        for entry, seen, forms, theirs in zip(tally.inputs, tally.columns, tally.forms, doc["inputs"]):
            for key in ("rows_read", "pairs", "rejected"):
                entry[key] += theirs[key]
            seen.update(theirs["columns"])
            forms.update(theirs["forms"])
        counts = doc["counts"]
        tally.source_pairs.update(counts["sources"])
        tally.source_rejects.update(counts["source_rejects"])
        tally.by_reason.update(counts["by_reason"])
        tally.truncated_prompts += counts["truncated_prompts"]
        tally.truncated_prompt_tokens += counts["truncated_prompt_tokens"]
        tally.max_token_id = max(tally.max_token_id, counts["max_token_id"])
        tally.rows_total = doc["rows_total"]
    return tally


def _link_shards(
    staging: Path, parts: list[tuple[Path, dict]], tally: Tally, recounts: list[Recount], progress: bool
) -> list[ShardInfo]:
    """Hard-link every part's shards into `staging` in span order, then hash the links against their part.json
    and read them; adds their pairs, lengths and sources (in order of first appearance) to `tally`, and what
    each holds to its part's `Recount`."""
    listed = sorted(((s, d, doc) for d, doc in parts for s in doc["shards"]), key=lambda x: x[0]["span"])
    (staging / SHARD_DIR).mkdir()
    shards = []
    with Stage("merge: hashing the linked shards", total=len(listed), enabled=progress, unit="shards") as stage:
        for shard, part_dir, doc in listed:
            target = staging / shard["path"]
            _link(part_dir / shard["path"], target)
            problems = file_problems(
                target, shard["bytes"], shard["sha256"], f"{part_dir}/{shard['path']}", "its part.json"
            )
            if problems:
                raise DataError(f"{problems[0]}; rebuild that part (dpo-data build ... --part K/N --overwrite)")
            table = _read_shard(part_dir / shard["path"], target)
            lengths = _check_shard(part_dir, doc, shard, table)
            recounts[doc["part"]["index"]].add_shard(shard, table, lengths)
            tally.lengths.append(lengths)
            if tally.images is not None:
                _count_images(named=f"{part_dir}/{shard['path']}", table=table, images=tally.images)
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


def _read_shard(named: Path, path: Path) -> pa.Table:
    try:
        return open_shard(path)
    except (pa.ArrowException, OSError) as e:
        raise DataError(f"{named}: not a readable shard ({e}); rebuild that part") from None


def _check_shard(part_dir: Path, doc: dict, shard: dict, table: pa.Table) -> np.ndarray:
    """What the part.json says of a shard against what it holds: its rows, each of its own span (increasing) and
    of an input of the build, its own source ids in order of first appearance (as `ShardWriter` numbers them),
    and `*_len` columns that are its lists' lengths. Returns its [prompt, chosen, rejected] lengths per pair."""
    named = f"{part_dir}/{shard['path']}"
    if table.num_rows != shard["rows"]:
        raise DataError(
            f"{named} holds {table.num_rows} pairs, its part.json says {shard['rows']}; the part.json was edited "
            "or damaged: rebuild that part"
        )
    span_rows = doc["plan"]["options"]["pairs_per_shard"]
    lo, hi = shard["span"] * span_rows, (shard["span"] + 1) * span_rows - 1
    rows = as_numpy(table.column("row_index"))
    problems = []
    if rows.size and (np.any(np.diff(rows) <= 0) or rows[0] < lo or rows[-1] > hi):
        problems.append(f"row_index is not increasing within span {shard['span']}, rows {lo} to {hi}")
    local = as_numpy(table.column("source_id"))
    ids, first = np.unique(local, return_index=True)
    if not np.array_equal(ids[np.argsort(first)], np.arange(len(shard["sources"]))):
        problems.append(f"its source ids, by first appearance, are not 0..{len(shard['sources']) - 1} (its sources)")
    inputs = as_numpy(table.column("input_index"))
    if inputs.size and (inputs.min() < 0 or inputs.max() >= len(doc["inputs"])):
        problems.append(f"input_index outside 0..{len(doc['inputs']) - 1} (the build's inputs)")
    lengths = np.stack([as_numpy(pc.list_value_length(table.column(f"{p}_ids"))) for p in PARTS], axis=1)
    stated = np.stack([as_numpy(table.column(f"{p}_len")) for p in PARTS], axis=1)
    if not np.array_equal(lengths, stated):
        problems.append("its *_len columns are not the lengths of its *_ids lists")
    if problems:
        raise DataError(f"{named}: {'; '.join(problems)}; the shard is not its span's: rebuild that part")
    return lengths.astype(np.int32)


def _count_images(named: str, table: pa.Table, images: ImageTally) -> None:
    """A vision shard's images, counted as the build counts them."""
    if "image_bytes" not in table.column_names:
        raise DataError(f"{named}: a shard of a vision build without its image_bytes column; rebuild that part")
    column = table.column("image_bytes")
    per_pair = as_numpy(pc.list_value_length(column)).tolist()
    sizes = as_numpy(pc.binary_length(pc.list_flatten(column))).tolist()
    images.add(per_pair, sizes)


def _max_token_id(table: pa.Table) -> int:
    """The largest token id in a shard's id columns (0 when it has none), as the build counts it."""
    found = [pc.max(pc.list_flatten(table.column(f"{p}_ids"))).as_py() for p in PARTS]
    return max([0, *(v for v in found if v is not None)])


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


def _merge_rejects(staging: Path, parts: list[tuple[Path, dict]], recounts: list[Recount]) -> None:
    """One rejects.jsonl in input order: each part's is in input order, so a k-way merge by (input, row); each
    record is counted into its part's `Recount` as it passes."""
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
        keyed = [
            _keyed(f, _part(doc).label, part_dir / REJECTS_NAME, index, recount)
            for f, (part_dir, doc), recount in zip(files, parts, recounts)
        ]
        with open(staging / REJECTS_NAME, "wb") as merged:
            merged.writelines(line for _, line in heapq.merge(*keyed, key=lambda item: item[0]))
    finally:
        for f in files:
            f.close()


def _keyed(
    lines: Iterator[bytes], label: str, path: Path, index: dict[str, int], recount: Recount
) -> Iterator[tuple[tuple[int, int], bytes]]:
    """A part's reject lines keyed by (input, row), each checked: a record, of an input of the build, in input
    order (the k-way merge relies on it)."""
    previous = (-1, 0)
    for number, line in enumerate(lines, 1):
        where = f"part {label}: {path} line {number}"
        try:
            record = reject_record(line)
        except DataError as e:
            raise DataError(f"{where}: {e}; the file was edited or damaged: rebuild that part") from None
        if record["file"] not in index:
            raise DataError(
                f"{where}: file {record['file']!r} is not an input of the build ({', '.join(index)}); the file was "
                "edited or damaged: rebuild that part"
            )
        key = (index[record["file"]], record.get("line", record.get("row")))
        if key <= previous:
            raise DataError(
                f"{where}: not in input order (after row {previous[1]} of input {previous[0]}); the file was edited "
                "or damaged: rebuild that part"
            )
        previous = key
        recount.add_reject(record, key[0])
        yield key, line


def _options(recorded: dict) -> tuple:
    """The `BuildOptions` the parts were built with (for the refusal checks), and the recorded override template."""
    from dpo_data.prepare.options import BuildOptions

    template = recorded.get("chat_template")
    given = {k: v for k, v in recorded.items() if k != "chat_template"}
    options = BuildOptions(**given, chat_template=None if template is None else template["file"])
    return options, template
