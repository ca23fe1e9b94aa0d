"""`dpo-data filter`: a dataset without the pairs of the kinds named, written and attested as a build's, its
lineage in the manifest and every dropped pair a record of its rejects.jsonl (docs/audit.md)."""

from __future__ import annotations

import heapq
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.compute as pc

from dpo_data.audit.findings import DEGENERATE_KINDS, AuditOptions, Findings, find
from dpo_data.dataset.manifest import REJECTS_NAME, ImageTally, dataset_fingerprint, read_manifest, write_manifest
from dpo_data.dataset.shards import PARTS, PairBlock, ShardWriter, as_numpy, open_shard
from dpo_data.dataset.store import PairStore
from dpo_data.dataset.verify import reject_record, shard_problems
from dpo_data.errors import DataError
from dpo_data.prepare.output import OutputLock, check_inputs_outside, commit_staged
from dpo_data.prepare.tally import BuildResult, Tally, manifest_document
from dpo_data.progress import Stage

KINDS = ("exact_duplicates", "conflicting_pairs", "near_duplicate_prompts", "contaminated_prompts", *DEGENERATE_KINDS)
"""What --drop names; a pair of several kinds is recorded under the first in this order."""


@dataclass(frozen=True)
class FilterOptions:
    """What `filter_dataset` drops, and how the audit compares."""

    drop: tuple[str, ...]
    keep_first: bool = False
    """conflicting_pairs: keep each conflict's first pair (its side), drop the other side; else drop both."""
    against: tuple[str, ...] = ()
    audit: AuditOptions = AuditOptions()

    def __post_init__(self):
        unknown = [k for k in self.drop if k not in KINDS]
        if unknown or not self.drop:
            raise DataError(f"--drop {','.join(self.drop) or '(none)'}: allowed kinds: {', '.join(KINDS)}")
        if "contaminated_prompts" in self.drop and not self.against:
            raise DataError("--drop contaminated_prompts needs --against DIR: the datasets whose prompts must go")
        if "whitespace_equal" in self.drop and self.audit.whitespace is None:
            raise DataError("--drop whitespace_equal needs --tokenizer DIR (the dataset's own): which ids are spaces")


def filter_dataset(
    data_dir: str | Path, out: str | Path, options: FilterOptions, overwrite: bool = False, progress: bool = False
) -> BuildResult:
    """Write the dataset at `data_dir` less the pairs `options` drops into `out` (docs/audit.md)."""
    started = time.perf_counter()
    out = Path(out)
    store = PairStore([data_dir])
    problems = shard_problems([data_dir])  # the child is attested: its parent's bytes must be the attested ones
    if problems:
        raise DataError(f"{problems[0]}; the filter reads only an intact dataset: run dpo-data verify {data_dir}")
    against = PairStore(list(options.against)) if options.against else None
    found = find(store, against, options.audit, progress)
    kind, of = dropped(found, options)
    check_inputs_outside(out, [str(data_dir), *options.against])
    with OutputLock(out):
        result = commit_staged(
            out, overwrite, lambda staging: _write(staging, Path(data_dir), store, kind, of, options, against, progress)
        )
    result.seconds = time.perf_counter() - started
    return result


def dropped(found: Findings, options: FilterOptions) -> tuple[np.ndarray, np.ndarray]:
    """Per pair: the index in KINDS of the first kind it is dropped for (-1: kept), and the pair it duplicates,
    conflicts with or nears (-1: none). Duplicates and near-duplicates keep the first of each group; a conflict
    loses both sides, or with keep_first the side opposite its first pair."""
    n = len(found.duplicate_of)
    kind, of = np.full(n, -1, np.int64), np.full(n, -1, np.int64)
    conflict = found.conflicts_with >= 0
    if options.keep_first:  # the first pair's side is kept (its copies are exact duplicates)
        own_first = np.where(found.duplicate_of >= 0, found.duplicate_of, np.arange(n))
        conflict &= found.conflicts_with < own_first
    links = {
        "exact_duplicates": (found.duplicate_of >= 0, found.duplicate_of),
        "conflicting_pairs": (conflict, found.conflicts_with),
        "near_duplicate_prompts": (found.near_duplicate_of >= 0, found.near_duplicate_of),
        "contaminated_prompts": (found.contaminated_by >= 0, found.contaminated_by),
    }
    for k, name in enumerate(KINDS):
        if name not in options.drop:
            continue
        hit, link = links[name] if name in links else (found.degenerate[name], None)
        new = hit & (kind < 0)
        kind[new] = k
        if link is not None:
            of[new] = link[new]
    return kind, of


def _write(staging, data_dir, store, kind, of, options, against, progress) -> BuildResult:
    parent = read_manifest(data_dir)
    tally = _tally(parent, store.vision)
    writer = ShardWriter(staging, store.vision)
    records = []
    with Stage("filter: writing the kept pairs", total=len(parent["shards"]), enabled=progress, unit="shards") as shown:
        for shard in parent["shards"]:
            table = open_shard(data_dir / shard["path"])
            rows = np.arange(shard["first_pair_index"], shard["first_pair_index"] + shard["rows"])
            keep = kind[rows] < 0
            block, sources = _block(table.filter(pa.array(keep)), shard["sources"])
            writer.add(block, sources, int(shard["path"].rsplit("-", 1)[1].split(".")[0]))
            _count(tally, block, sources)
            records += _records(parent, table, shard, rows[~keep], kind, of)
            shown.advance()
    shards = writer.close()
    for shard in shards:
        for name in shard.sources:
            tally.sources.setdefault(name, len(tally.sources))
    _write_rejects(staging, data_dir, parent, records, tally)
    lineage = _lineage(parent, options, against, tally)
    _truncation(parent, store, kind, tally, lineage)
    manifest = manifest_document(
        tally, shards, parent["tokenizer"], parent["producer"]["options"], staging, parent.get("processor")
    )
    manifest["lineage"] = lineage
    manifest["fingerprint"] = dataset_fingerprint(
        parent["tokenizer"]["fingerprint"],
        manifest["sources"],
        manifest["shards"],
        parent["producer"]["options"].get("columns"),
        parent["processor"]["fingerprint"] if store.vision else None,
        lineage,
    )
    if tally.pairs == 0:
        return BuildResult(
            staging,
            None,
            tally.rows_total,
            0,
            dict(tally.by_reason),
            0.0,
            error="the filter dropped every pair: nothing would be left to train on",
        )
    write_manifest(staging, manifest)
    result = BuildResult(staging, manifest, manifest["totals"]["rows_read"], tally.pairs, dict(tally.by_reason), 0.0)
    result.prompt_tokens = manifest["totals"]["prompt_tokens"]
    result.completion_tokens = manifest["totals"]["completion_tokens"]
    return result


def _tally(parent: dict, vision: bool) -> Tally:
    """A tally holding the parent's inputs (pairs and rejects to be recounted) and its rejects."""
    inputs = []
    for entry in parent["inputs"]:
        kept = {k: v for k, v in entry.items() if k != "forms"}  # a pair's form is not in its shard
        inputs.append({**kept, "pairs": 0})
    tally = Tally(inputs=inputs, columns=[], forms=[])
    tally.by_reason.update(parent["rejects"]["by_reason"])
    tally.source_rejects.update(parent["rejects"]["by_source"])
    tally.rows_total = parent["totals"]["rows_read"]
    tally.images = ImageTally() if vision else None
    return tally


def _block(table: pa.Table, names: list[str]) -> tuple[PairBlock, list[str]]:
    """A shard's kept rows as the writer takes them, with their source names."""
    table = table.combine_chunks()
    lengths = np.stack([as_numpy(table.column(f"{p}_len")) for p in PARTS], axis=1).astype(np.int32)
    ids = {p: as_numpy(pc.list_flatten(table.column(f"{p}_ids"))).astype(np.int32) for p in PARTS}
    vision = "image_bytes" in table.column_names
    block = PairBlock(
        source_id=as_numpy(table.column("source_id")).astype(np.int32),
        row_index=as_numpy(table.column("row_index")).astype(np.int64),
        input_index=as_numpy(table.column("input_index")).astype(np.int32),
        input_row=as_numpy(table.column("input_row")).astype(np.int64),
        lengths=lengths,
        **ids,
        row_id=table.column("row_id").to_pylist(),
        image_bytes=table.column("image_bytes").to_pylist() if vision else None,
        image_sha256=table.column("image_sha256").to_pylist() if vision else None,
    )
    return block, [names[k] for k in block.source_id]


def _count(tally: Tally, block: PairBlock, sources: list[str]) -> None:
    tally.pairs += len(block)
    tally.lengths.append(block.lengths)
    tally.source_pairs.update(sources)
    for i, n in Counter(block.input_index.tolist()).items():
        tally.inputs[i]["pairs"] += n
    for part in PARTS:
        values = getattr(block, part)
        tally.max_token_id = max(tally.max_token_id, int(values.max()) if len(values) else 0)
    if tally.images is not None:
        tally.images.add([len(x) for x in block.image_bytes], [len(b) for x in block.image_bytes for b in x])


def _records(parent: dict, table: pa.Table, shard: dict, pairs: np.ndarray, kind, of) -> list[tuple]:
    """The ledger's records of a shard's dropped pairs, keyed by (input, row) as the build orders rejects."""
    out = []
    local = pairs - shard["first_pair_index"]
    columns = {c: table.column(c).take(pa.array(local)).to_pylist() for c in ("input_index", "input_row", "source_id")}
    for pair, i, row, source in zip(pairs, columns["input_index"], columns["input_row"], columns["source_id"]):
        entry = parent["inputs"][i]
        name, link = KINDS[kind[pair]], int(of[pair])
        locator = "line" if entry["format"] in ("jsonl", "jsonl.zst") else "row"
        record = {
            "file": entry["path"],
            locator: row,
            "source": shard["sources"][source],
            "reason": name,
            "message": _message(name, int(pair), link),
            "raw": "",
            "pair": int(pair),
            "of": link if link >= 0 else None,
            "parent": parent["fingerprint"],
        }
        out.append(((i, row), record))
    return out


def _message(kind: str, pair: int, link: int) -> str:
    said = {
        "exact_duplicates": f"pair {pair} equals pair {link} (kept)",
        "conflicting_pairs": f"pair {pair} has pair {link}'s prompt with chosen and rejected swapped",
        "near_duplicate_prompts": f"pair {pair}'s prompt nears pair {link}'s (kept), the first of its cluster",
        "contaminated_prompts": f"pair {pair}'s prompt equals or nears --against pair {link}'s",
    }
    return "dpo-data filter --drop: " + said.get(kind, f"pair {pair} is degenerate ({kind})")


def _write_rejects(staging: Path, data_dir: Path, parent: dict, records: list[tuple], tally: Tally) -> None:
    """The parent's rejects and the dropped pairs' records, merged in input order (the build's order)."""
    index = {entry["path"]: i for i, entry in enumerate(parent["inputs"])}
    for (i, _), record in records:
        tally.by_reason[record["reason"]] += 1
        tally.source_rejects[record["source"]] += 1
        tally.inputs[i]["rejected"] += 1
    ours = ((key, orjson.dumps(record) + b"\n") for key, record in records)
    with open(data_dir / REJECTS_NAME, "rb") as theirs, open(staging / REJECTS_NAME, "wb") as f:
        keyed = _keyed(theirs, index, data_dir / REJECTS_NAME)
        f.writelines(line for _, line in heapq.merge(keyed, ours, key=lambda item: item[0]))


def _keyed(lines: Iterator[bytes], index: dict[str, int], path: Path) -> Iterator[tuple[tuple[int, int], bytes]]:
    """The parent's reject lines keyed by (input, row); a line that is no record of one of its inputs is named."""
    for number, line in enumerate(lines, 1):
        try:
            record = reject_record(line)
            if record["file"] not in index:
                raise DataError(f"file {record['file']!r} is not an input of the dataset")
        except DataError as e:
            raise DataError(f"{path} line {number}: {e}; run dpo-data verify on the dataset") from None
        yield (index[record["file"]], record.get("line", record.get("row"))), line


def _lineage(parent: dict, options: FilterOptions, against: PairStore | None, tally: Tally) -> dict:
    before = parent.get("lineage")
    return {
        "parent": parent["fingerprint"],
        "ancestors": [] if before is None else [before["parent"], *before["ancestors"]],
        "filter": {
            "drop": [k for k in KINDS if k in options.drop],
            "keep_first": options.keep_first,
            "threshold": options.audit.threshold,
            "ngram": options.audit.ngram,
            "last_k": options.audit.last_k,
            "against": [] if against is None else against.dataset_fingerprints,
        },
        "dropped": {
            k: tally.by_reason[k] - parent["rejects"]["by_reason"].get(k, 0)
            for k in KINDS
            if tally.by_reason[k] > parent["rejects"]["by_reason"].get(k, 0)
        },
    }


def _truncation(parent: dict, store: PairStore, kind: np.ndarray, tally: Tally, lineage: dict) -> None:
    """The truncated-prompt counts of what is kept. The build counted them, not which pairs: while no pair the
    build may have truncated (at exactly --max-length) is dropped, the parent's stand; else the pairs certainly
    still truncated (exact when every such pair was) and their share of the tokens lost, marked as estimated."""
    prompts, tokens = parent["totals"]["truncated_prompts"], parent["totals"]["truncated_prompt_tokens"]
    options = parent["producer"]["options"]
    lost = 0
    if prompts and options["overlength"] == "truncate-prompt" and options["max_length"] is not None:
        longer = np.maximum(store.chosen_len, store.rejected_len).astype(np.int64)
        at_limit = store.prompt_len.astype(np.int64) + longer == options["max_length"]
        lost = int((at_limit & (kind >= 0)).sum())
    if lost:
        kept = max(0, prompts - lost)
        prompts, tokens = kept, 0 if not kept else max(kept, round(tokens * kept / prompts))
        lineage["truncation_estimated"] = True
    tally.truncated_prompts, tally.truncated_prompt_tokens = prompts, tokens
