"""What a built dataset holds (`dpo-data inspect`) and whether it is intact (`dpo-data verify`)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa

from dpo_data.dataset.manifest import (
    MANIFEST_NAME,
    ImageTally,
    is_vision,
    length_histogram,
    length_stats,
    manifest_problems,
    read_manifest,
    recorded_chat_template,
)
from dpo_data.dataset.shards import as_numpy, image_views, open_shard, read_batches, shard_schema
from dpo_data.errors import DataError
from dpo_state.files import file_problems


def inspect_dataset(data_dir: str | Path) -> dict[str, Any]:
    """A summary of a dataset read from its manifest alone (no shard is opened)."""
    m = read_manifest(data_dir)
    totals = m["totals"]
    vision = {"images": m["images"], "processor_fingerprint": m["processor"]["fingerprint"]} if is_vision(m) else {}
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
        **vision,
        **({"lineage": m["lineage"]} if "lineage" in m else {}),
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
    if "images" in info:
        images = info["images"]
        lines[5:5] = [
            f"images       {images['count']} in {images['pairs']} pairs (at most {images['max_per_pair']} a pair), "
            f"{images['bytes']} bytes",
            f"processor    {info['processor_fingerprint']}",
        ]
    if "lineage" in info:  # a dpo-data filter output: what it was filtered from, and what went
        lineage = info["lineage"]
        dropped = ", ".join(f"{k} {n}" for k, n in lineage["dropped"].items()) or "nothing"
        lines.insert(3, f"filtered     from {lineage['parent']} (dropped {dropped}; docs/audit.md)")
    if info["truncated_prompts"]:
        lines.insert(
            5,
            f"truncated    {info['truncated_prompts']} prompts lost their oldest tokens (--overlength truncate-prompt)",
        )
    return "\n".join(lines)


def verify_dataset(
    data_dir: str | Path, tokenizer_dir: str | None = None, strict: bool = False, inputs: list[str] | None = None
) -> list[str]:
    """Every failure found; an empty list means the dataset is intact.

    Checked: the manifest's schema, version and self-consistency (fingerprint, tokenizer digest, counts);
    every shard's bytes, sha256, Arrow footer, schema and rows; the rejects file's bytes, sha256 and
    records; what the manifest states about the data, recomputed from the shards (token totals, length
    statistics and histogram, largest token id, per-source pairs, each shard's rows within its span). With
    `tokenizer_dir`, the tokenizer attestation; with `strict`, files the manifest does not name; with `inputs`,
    the raw input files against their recorded bytes and sha256. A vision dataset's images: each one's sha256
    against its image_sha256 entry (naming the pair), and the manifest's `images` counts; with `tokenizer_dir`
    (there, the directory holding the processor) the processor attestation as well.
    """
    root = Path(data_dir)
    try:
        m = read_manifest(root, consistent=False)
    except DataError as e:
        return [str(e)]
    failures = [f"{MANIFEST_NAME}: {problem}" for problem in manifest_problems(m)]
    tables = []
    for shard in m["shards"]:
        problems, table = _check_shard(root, shard, shard_schema(is_vision(m)))
        failures += problems
        tables.append(table)
    rejects = m["rejects"]
    failures += file_problems(
        root / rejects["file"], rejects["bytes"], rejects["sha256"], rejects["file"], "the manifest"
    )
    failures += _check_rejects(root, m)
    if tables and all(t is not None for t in tables):
        failures += _check_content(m, pa.concat_tables(tables))
        failures += _check_spans(m, tables)
        if is_vision(m):
            failures += _check_images(m, root)
    if strict:
        failures += [
            f"{name}: in the dataset directory but not named by the manifest (--strict)"
            for name in unlisted_files(root, m)
        ]
    if inputs:
        failures += _check_inputs(m, inputs)
    if tokenizer_dir is not None:
        failures += _check_tokenizer(m, tokenizer_dir)
    return failures


VERIFY_MODES = ("full", "size")


def shard_problems(
    dirs: list[str | Path], mode: str = "full", part: tuple[int, int] = (0, 1), threads: int = 4
) -> list[str]:
    """Check the shards of datasets `dirs` against their manifests before a reader uses them: size, and
    with mode "full" sha256 too. `part` = (k, n) checks every n-th shard from the k-th, so n ranks share
    the work; `threads` hash in parallel (sha256 releases the GIL). Each file is read once."""
    from concurrent.futures import ThreadPoolExecutor

    if mode not in VERIFY_MODES:
        raise DataError(f"data.verify is {mode!r}; allowed: {', '.join(VERIFY_MODES)}")
    files = [(Path(d) / s["path"], s, str(d)) for d in dirs for s in read_manifest(d)["shards"]]
    mine = files[part[0] :: part[1]]

    def check(item: tuple[Path, dict, str]) -> list[str]:
        path, shard, directory = item
        return file_problems(
            path,
            shard["bytes"],
            shard["sha256"],
            f"dataset {directory}: {shard['path']}",
            "its manifest",
            hashes=mode == "full",
        )

    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        return [problem for problems in pool.map(check, mine) for problem in problems]


def unlisted_files(data_dir: str | Path, manifest: dict | None = None) -> list[str]:
    """Files in the dataset directory that its manifest does not name (a leftover, or something added)."""
    root = Path(data_dir)
    m = manifest or read_manifest(root, consistent=False)
    named = {MANIFEST_NAME, m["rejects"]["file"], *(s["path"] for s in m["shards"])}
    return sorted(
        rel for rel in (p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file()) if rel not in named
    )


def _check_shard(root: Path, shard: dict, schema: pa.Schema) -> tuple[list[str], pa.Table | None]:
    failures = file_problems(root / shard["path"], shard["bytes"], shard["sha256"], shard["path"], "the manifest")
    if failures and "missing" in failures[0]:
        return failures, None
    try:
        table = open_shard(root / shard["path"])
    except (pa.ArrowException, OSError, ValueError) as e:
        return failures + [f"{shard['path']}: not a readable Arrow IPC file ({type(e).__name__}: {e})"], None
    if table.schema != schema:
        return failures + [f"{shard['path']}: columns {table.schema.names} differ from the shard schema"], None
    if table.num_rows != shard["rows"]:
        failures.append(f"{shard['path']}: {table.num_rows} rows, manifest says {shard['rows']}")
    return failures, table


def _check_rejects(root: Path, m: dict) -> list[str]:
    """The rejects file's records against the manifest: their count, and the counts by reason, by source and
    by input recounted from them."""
    name, rejects = m["rejects"]["file"], root / m["rejects"]["file"]
    if not rejects.is_file():
        return []
    by_reason, by_source, by_file, lines, filtered = Counter(), Counter(), Counter(), 0, Counter()
    lineage = m.get("lineage")
    with open(rejects, "rb") as f:
        for lines, line in enumerate(f, 1):
            try:
                record = reject_record(line)
            except DataError as e:
                return [f"{name} line {lines}: {e}"]
            by_reason[record["reason"]] += 1
            by_source[record["source"]] += 1
            by_file[record["file"]] += 1
            if lineage is not None and record.get("parent") == lineage["parent"]:
                filtered[record["reason"]] += 1
    if lines != m["rejects"]["count"]:
        return [f"{name}: {lines} records, manifest says {m['rejects']['count']}"]
    failures = [
        f"rejects.{key}: manifest says {m['rejects'][key]}, {name} holds {dict(sorted(counted.items()))}"
        for key, counted in (("by_reason", by_reason), ("by_source", by_source))
        if m["rejects"][key] != counted
    ]
    failures += [
        f"input {entry['path']}: manifest says {entry['rejected']} rejected, {name} holds {by_file[entry['path']]}"
        for entry in m["inputs"]
        if entry["rejected"] != by_file[entry["path"]]
    ]
    if lineage is not None and dict(filtered) != lineage["dropped"]:
        failures.append(
            f"lineage.dropped: manifest says {lineage['dropped']}, {name} holds {dict(sorted(filtered.items()))} "
            "records of pairs dropped from the parent"
        )
    return failures


def reject_record(line: bytes) -> dict:
    """One line of a rejects file, parsed, with the fields a count reads (file, line or row, source, reason);
    anything else is a `DataError` saying what is wrong (the caller names the file and the line)."""
    try:
        record = orjson.loads(line)
    except orjson.JSONDecodeError as e:
        raise DataError(f"not a JSON line ({e})") from None
    if not isinstance(record, dict):
        raise DataError(f"a JSON {type(record).__name__}, not a reject record (an object)")
    locator = record.get("line", record.get("row"))
    if not isinstance(locator, int) or isinstance(locator, bool) or locator < 1:
        raise DataError(f"its line or row is {locator!r}; a reject record names its row by a number >= 1")
    for key in ("file", "source", "reason"):
        if not isinstance(record.get(key), str):
            raise DataError(f"its {key} is {record.get(key)!r}; a reject record names its {key} as a string")
    return record


def truncation_problems(prompts: int, tokens: int, lengths: np.ndarray, options: dict, where: str) -> list[str]:
    """Truncated-prompt counts the shards can bound: a truncated prompt leaves its pair at exactly --max-length
    (prompt + longest completion, `PairEncoder._finish`), so at most that many prompts were truncated, none
    without --overlength truncate-prompt, and each lost at least one token. `lengths` is [pairs, 3]."""
    limit = options.get("max_length") if options.get("overlength") == "truncate-prompt" else None
    if limit is None:
        marked, bound = 0, "0 (the build truncated nothing: --overlength reject or no --max-length)"
    else:
        marked = int((lengths[:, 0] + lengths[:, 1:].max(axis=1, initial=0) == limit).sum())
        bound = f"at most {marked}, the pairs whose prompt + longest completion is exactly --max-length {limit}"
    problems = []
    if prompts > marked:
        problems.append(f"{where}truncated_prompts is {prompts}; allowed: {bound}")
    if tokens < prompts or (tokens and not prompts):
        problems.append(
            f"{where}truncated_prompt_tokens is {tokens} for {prompts} truncated prompts; each truncated prompt "
            "loses at least one token, and no token is lost without one"
        )
    return problems


def _check_content(m: dict, table: pa.Table) -> list[str]:
    """What the manifest states about the data, recomputed from the shards' columns."""
    import pyarrow.compute as pc

    failures = []
    lengths = {}
    for part in ("prompt", "chosen", "rejected"):
        ids, stated = table.column(f"{part}_ids"), table.column(f"{part}_len")
        actual = as_numpy(pc.list_value_length(ids)).astype(np.int64)
        if not np.array_equal(actual, as_numpy(stated)):
            failures.append(f"shards: {part}_len disagrees with the length of {part}_ids")
        lengths[part] = actual
        values = pc.list_flatten(ids)
        if len(values) and int(pc.min(values).as_py()) < 0:
            failures.append(f"shards: negative token ids in {part}_ids")
    segments = np.concatenate([lengths["prompt"] + lengths["chosen"], lengths["prompt"] + lengths["rejected"]])
    totals = m["totals"]
    failures += truncation_problems(
        totals["truncated_prompts"],
        totals["truncated_prompt_tokens"],
        np.stack([lengths[p] for p in ("prompt", "chosen", "rejected")], axis=1),
        m["producer"]["options"],
        "totals.",
    )
    recomputed = {
        "prompt_tokens": int(lengths["prompt"].sum()),
        "chosen_tokens": int(lengths["chosen"].sum()),
        "rejected_tokens": int(lengths["rejected"].sum()),
        "input_tokens": int(segments.sum()),
        "max_token_id": max(
            int(pc.max(pc.list_flatten(table.column(f"{p}_ids"))).as_py() or 0)
            for p in ("prompt", "chosen", "rejected")
        ),
    }
    failures += [
        f"totals.{k}: manifest says {totals[k]}, the shards hold {v}" for k, v in recomputed.items() if totals[k] != v
    ]
    stats = {
        "prompt": length_stats(lengths["prompt"]),
        "chosen": length_stats(lengths["chosen"]),
        "rejected": length_stats(lengths["rejected"]),
        "segment": length_stats(segments),
    }
    failures += [
        f"lengths.{k}: manifest says {m['lengths'][k]}, the shards give {v}"
        for k, v in stats.items()
        if m["lengths"][k] != v
    ]
    if m["length_histogram"] != length_histogram(segments):
        failures.append("length_histogram: differs from the histogram of the shards' segment lengths")
    return failures


def _check_spans(m: dict, tables: list[pa.Table]) -> list[str]:
    """The shards in ascending span order (the pair order is the span order: a swap reorders the dataset), each
    holding rows of its own span, in increasing row order, and source ids of its own sources; the pairs per
    source add up to the manifest's."""
    failures, counts, previous = [], Counter(), -1
    span_rows = m["producer"]["options"]["pairs_per_shard"]
    ids = {s["name"]: s["id"] for s in m["sources"]}
    for shard, table in zip(m["shards"], tables):
        rows = as_numpy(table.column("row_index"))
        span = int(shard["path"].rsplit("-", 1)[1].split(".")[0])
        if span <= previous:
            failures.append(
                f"{shard['path']}: listed after span {previous}; the manifest lists shards in ascending span order, "
                "so the pair order is the single build's: rebuild the dataset (or merge its parts again)"
            )
        previous = span
        lo, hi = span * span_rows, (span + 1) * span_rows - 1
        if rows.size and (np.any(np.diff(rows) <= 0) or rows[0] < lo or rows[-1] > hi):
            failures.append(f"{shard['path']}: row_index is not increasing within its span, rows {lo} to {hi}")
        local = as_numpy(table.column("source_id"))
        if bool((local < 0).any()) or bool((local >= len(shard["sources"])).any()):
            failures.append(f"{shard['path']}: source ids outside 0..{len(shard['sources']) - 1} (its sources)")
            continue
        counts.update({shard["sources"][k]: int(n) for k, n in enumerate(np.bincount(local)) if n})
    failures += [
        f"sources: {name} has {s_pairs} pairs in the manifest, {counts[name]} in the shards"
        for name, s_pairs in ((s["name"], s["pairs"]) for s in m["sources"])
        if counts[name] != s_pairs
    ]
    failures += [f"shards: source {name!r} is not among the manifest's sources" for name in counts if name not in ids]
    return failures


MAX_NAMED_IMAGES = 20
"""The image mismatches `verify` names one by one; past them it counts."""


def _check_images(m: dict, root: Path) -> list[str]:
    """Each image's bytes against its recorded sha256 (naming the pair: its shard, row, input and row id), and the
    manifest's `images` counts recounted. Streamed: one record batch of a shard in memory at a time (bounded by
    `RECORD_BATCH_IMAGE_BYTES`), its images hashed where they lie in the batch's buffer."""
    from dpo_data.images import image_sha256

    failures, counted = [], ImageTally()
    for shard in m["shards"]:
        first = 0  # the batch's first pair in the shard
        for batch in read_batches(root / shard["path"]):
            digests = batch.column("image_sha256").to_pylist()
            for j, (images, recorded) in enumerate(zip(image_views(batch.column("image_bytes")), digests)):
                counted.add([len(images)], [b.size for b in images])
                bad = [i for i, data in enumerate(images) if i >= len(recorded) or image_sha256(data) != recorded[i]]
                if bad or len(recorded) != len(images):
                    failures.append(_image_failure(m, shard, first + j, batch, j, bad, len(images), len(recorded)))
            first += batch.num_rows
    if len(failures) > MAX_NAMED_IMAGES:
        failures[MAX_NAMED_IMAGES:] = [f"... and {len(failures) - MAX_NAMED_IMAGES} more pairs with changed images"]
    if counted.record() != m["images"]:
        failures.append(f"images: manifest says {m['images']}, the shards hold {counted.record()}")
    return failures


def _image_failure(
    m: dict, shard: dict, k: int, batch: pa.RecordBatch, j: int, bad: list, count: int, digests: int
) -> str:
    """The failure of pair `k` of `shard` (row `j` of `batch`), named by its row, input place and row id."""
    row, index, number, row_id = (
        batch.column(c)[j].as_py() for c in ("row_index", "input_index", "input_row", "row_id")
    )
    inp = m["inputs"][index] if 0 <= index < len(m["inputs"]) else {"path": f"input {index}"}
    locator = "line" if inp.get("format") in ("jsonl", "jsonl.zst") else "row"
    pair = f"{shard['path']} pair {k} (row {row}: {inp['path']} {locator} {number}" + (
        f", id {row_id!r})" if row_id is not None else ")"
    )
    if count != digests:
        return f"{pair}: {count} images but {digests} image_sha256 entries"
    return f"{pair}: the bytes of image {', '.join(map(str, bad))} do not match their image_sha256 (changed)"


def _check_inputs(m: dict, inputs: list[str]) -> list[str]:
    """Re-hash raw input files against the manifest's record of them, matched by file name."""
    recorded = {Path(entry["path"]).name: entry for entry in m["inputs"]}
    failures = []
    for given in inputs:
        entry = recorded.get(Path(given).name)
        if entry is None:
            failures.append(
                f"--inputs {given}: not an input of this dataset (its inputs: {', '.join(sorted(recorded))})"
            )
            continue
        failures += file_problems(given, entry["bytes"], entry["sha256"], f"input {given}", "the manifest")
    return failures


def _check_tokenizer(m: dict, tokenizer_dir: str) -> list[str]:
    return attested_tokenizer(m, tokenizer_dir).failures


@dataclass(frozen=True)
class Attested:
    """A tokenizer directory loaded for a dataset, and every way it differs from the dataset's attestation."""

    tokenizer: Any
    """What the dataset's ids are read with (a vision dataset: its processor's rendering tokenizer), the dataset's
    --chat-template applied; None where the directory does not load."""
    processor: Any
    """A vision dataset's processor; None for text data or where it does not load."""
    failures: list[str]
    """Empty when the directory holds the tokenizer (and processor) the dataset was built with."""


def attested_tokenizer(m: dict, tokenizer_dir: str) -> Attested:
    """`tokenizer_dir` loaded as the build loads it and checked against manifest `m`'s attestation (`dpo-data verify
    --tokenizer`, `dpo-data show`)."""
    from dpo_data.tokenizer import load_tokenizer
    from dpo_state.attestation import attestation_mismatch, tokenizer_attestation

    if is_vision(m):
        return _attested_processor(m, tokenizer_dir)
    try:
        tokenizer = load_tokenizer(tokenizer_dir)
    except (OSError, ValueError) as e:
        return Attested(None, None, [f"--tokenizer {tokenizer_dir}: cannot load a tokenizer ({e})"])
    template = recorded_chat_template(m)
    if template is not None:  # as dpo-train does: the dataset's --chat-template replaces the tokenizer's own
        tokenizer.chat_template = template["text"]
    mismatch = attestation_mismatch(
        m["tokenizer"], tokenizer_attestation(tokenizer), f"tokenizer {tokenizer_dir}", "the dataset"
    )
    if mismatch is None:
        return Attested(tokenizer, None, [])
    return Attested(
        tokenizer, None, [f"{mismatch}; rebuild the dataset with this tokenizer or use the one it was built with"]
    )


def _attested_processor(m: dict, processor_dir: str) -> Attested:
    """A vision dataset's processor attestation (which holds the tokenizer's) against the processor in
    `processor_dir`, naming every differing component."""
    from dpo_data.processor import load_processor, rendering_tokenizer
    from dpo_state.attestation import attestation_mismatch, processor_attestation, tokenizer_attestation

    try:
        processor = load_processor(processor_dir)
    except DataError as e:
        return Attested(None, None, [str(e)])
    tokenizer = rendering_tokenizer(processor)
    template = recorded_chat_template(m)
    if template is not None:
        tokenizer.chat_template = template["text"]
    tokenizer_actual = tokenizer_attestation(tokenizer)
    actual = processor_attestation(processor, tokenizer_actual)
    label = f"processor {processor_dir}"
    failures = []
    mismatch = attestation_mismatch(m["processor"], actual, label, "the dataset")
    if mismatch is not None:
        failures.append(f"{mismatch}; rebuild the dataset with this processor or use the one it was built with")
    mismatch = attestation_mismatch(m["tokenizer"], tokenizer_actual, f"{label}'s tokenizer", "the dataset")
    if mismatch is not None:
        failures.append(f"{mismatch}; rebuild the dataset with this processor or use the one it was built with")
    return Attested(tokenizer, processor, failures)
