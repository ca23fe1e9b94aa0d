"""`dpo-data build`: raw preference rows -> tokenized pairs in Arrow shards, rejects, and a manifest written last."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import time
from collections import Counter
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from dpo_data import __version__
from dpo_data.dataset.manifest import (
    MANIFEST_FORMAT_VERSION,
    REJECTS_NAME,
    dataset_fingerprint,
    length_histogram,
    length_stats,
    write_manifest,
)
from dpo_data.dataset.shards import PARTS, PairBlock, ShardWriter
from dpo_data.errors import DataError
from dpo_data.prepare.columns import check_columns, ignored_columns, rename_columns
from dpo_data.prepare.hub import hub_files, is_hub_input
from dpo_data.prepare.inputs import InputFile, OversizedLine, iter_rows, open_input
from dpo_data.prepare.output import (
    OutputLock,
    check_inputs_outside,
    check_replaceable,
    new_staging,
    remove_stale_staging,
    swap_into_place,
)
from dpo_data.prepare.rows import RowReject, normalize_row
from dpo_data.prepare.template import read_chat_template
from dpo_data.prepare.tokenize import OVERLENGTH_MODES, PairEncoder, TokenizeOptions
from dpo_data.progress import Stage
from dpo_state.attestation import tokenizer_attestation
from dpo_state.digest import DIGEST_PREFIX, file_digest, sha256_json

CHUNK_ROWS = 256  # rows per unit of work sent to a worker
RAW_KEEP_CHARS = 2000  # what a reject keeps of its raw row


@dataclass(frozen=True)
class BuildOptions:
    """Options of one build. All but `num_proc`, `overwrite` and `progress` are recorded in the manifest.

    `columns` maps row fields onto the input's column names: {"prompt": "question", ...} or the CLI's
    "prompt=question,chosen=response_j,rejected=response_k"; it is kept as a checked dict in field order.

    `chat_template` is the path of a Jinja file that replaces the tokenizer's chat template (`--chat-template`);
    the manifest records its name, sha256 and text, and the build is refused when it is not prefix-stable."""

    max_length: int | None = None
    overlength: str = "reject"
    append_eos: bool = True
    source: str | None = None
    max_reject_fraction: float | None = None
    pairs_per_shard: int = 100_000
    max_row_bytes: int = 8 << 20
    columns: Mapping[str, str] | str | None = None
    chat_template: str | Path | None = None
    num_proc: int = 1
    overwrite: bool = False
    progress: bool = False

    def __post_init__(self):
        if self.max_length is not None and self.max_length < 2:
            raise DataError(
                f"--max-length is {self.max_length}; it must be at least 2 (one prompt and one completion token)"
            )
        if self.overlength not in OVERLENGTH_MODES:
            raise DataError(f"--overlength is {self.overlength!r}; allowed: {', '.join(OVERLENGTH_MODES)}")
        if self.max_reject_fraction is not None and not 0.0 <= self.max_reject_fraction <= 1.0:
            raise DataError(f"--max-reject-fraction is {self.max_reject_fraction}; it must lie in [0, 1]")
        if self.pairs_per_shard < 1:
            raise DataError(f"--pairs-per-shard is {self.pairs_per_shard}; it must be at least 1")
        if self.max_row_bytes < 1024:
            raise DataError(f"--max-row-bytes is {self.max_row_bytes}; it must be at least 1024")
        if self.num_proc < 1:
            raise DataError(f"--num-proc is {self.num_proc}; it must be at least 1")
        if self.columns is not None:
            object.__setattr__(self, "columns", check_columns(self.columns))

    def recorded(self, chat_template: dict | None = None) -> dict[str, Any]:
        """The options that shape the output (recorded in the manifest; --num-proc never changes a byte), with
        the override template as `read_chat_template` read it."""
        skip = {"num_proc", "overwrite", "progress", "chat_template"}
        if self.columns is None:
            skip.add("columns")  # left out, not null: a build without a mapping records what it always did
        options = {k: v for k, v in asdict(self).items() if k not in skip}
        if chat_template is not None:  # likewise only when given
            options["chat_template"] = chat_template
        return options


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

    @property
    def rejected(self) -> int:
        return sum(self.rejects_by_reason.values())


# -- worker side --------------------------------------------------------------------------------

_worker: dict[str, Any] = {}


def _init_worker(tokenizer: Any, options: BuildOptions, inputs: list[InputFile]) -> None:
    """Set up this process's encoder (the build process itself, or a forked pool worker)."""
    topts = TokenizeOptions(options.max_length, options.overlength, options.append_eos)
    _worker.update(encoder=PairEncoder(tokenizer, topts), options=options, inputs=inputs)


@dataclass
class ChunkResult:
    """A worker's output for one chunk: its pairs as a block (source ids not yet assigned), the source
    name and truncated-prompt count of each pair, and its rejects, all in input order."""

    block: PairBlock
    sources: list[str]
    truncated: list[int]
    rejects: list[tuple[int, dict]]
    columns: dict[int, Counter]
    """Per input index: how many of the chunk's rows (objects) have each column."""


def _init_pool_worker(tokenizer: Any, options: BuildOptions, inputs: list[InputFile]) -> None:
    """One pool worker per core: its Rust tokenizer stays single-threaded, or N workers would each
    start a thread per core and fight over them (measured: 20% more CPU time at 2 workers)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _init_worker(tokenizer, options, inputs)


def _process_chunk(chunk: list[tuple[int, int, Any]]) -> ChunkResult:
    """Parse, validate and encode a chunk of rows."""
    inputs, options, encoder = _worker["inputs"], _worker["options"], _worker["encoder"]
    rejects, pairs, where, columns = [], [], [], {}
    for input_index, number, item in chunk:
        inp = inputs[input_index]
        row = None
        try:
            row = _parse(item, options.max_row_bytes)
            if isinstance(row, dict):
                columns.setdefault(input_index, Counter()).update(row.keys())
            pairs.append(normalize_row(rename_columns(row, options.columns) if options.columns else row))
            where.append((input_index, number, item))
        except RowReject as reject:
            rejects.append(_reject(input_index, inp, number, _row_source(row, inp), reject, item))
    kept, sources, truncated, ids = [], [], [], {part: [] for part in PARTS}
    for (input_index, number, item), pair, encoded in zip(where, pairs, encoder.encode_many(pairs)):
        source = pair.source or inputs[input_index].source
        if isinstance(encoded, RowReject):
            rejects.append(_reject(input_index, inputs[input_index], number, source, encoded, item))
            continue
        kept.append((input_index, number, pair.id, len(encoded.prompt), len(encoded.chosen), len(encoded.rejected)))
        sources.append(source)
        truncated.append(encoded.truncated_prompt_tokens)
        for part in PARTS:
            ids[part].extend(getattr(encoded, part))
    rejects.sort(key=lambda r: (r[0], r[1][inputs[r[0]].locator]))  # input order, whichever stage rejected
    return ChunkResult(_block(kept, ids), sources, truncated, rejects, columns)


def _block(kept: list[tuple], ids: dict[str, list[int]]) -> PairBlock:
    return PairBlock(
        source_id=np.zeros(len(kept), dtype=np.int32),
        input_index=np.array([k[0] for k in kept], dtype=np.int32),
        input_row=np.array([k[1] for k in kept], dtype=np.int64),
        lengths=np.array([k[3:] for k in kept], dtype=np.int32).reshape(-1, 3),
        row_id=[k[2] for k in kept],
        **{part: np.array(ids[part], dtype=np.int32) for part in PARTS},
    )


def _row_source(row: Any, inp: InputFile) -> str:
    """The source a rejected row is counted under: its own valid 'source' field, else its input's."""
    own = row.get("source") if isinstance(row, dict) else None
    return own if isinstance(own, str) and own.strip() else inp.source


def _parse(item: Any, max_row_bytes: int) -> Any:
    if isinstance(item, OversizedLine):
        raise RowReject("row_too_large", f"the row has {item.size} bytes, over --max-row-bytes {max_row_bytes}")
    if not isinstance(item, bytes):  # .json / .parquet rows arrive parsed
        size = len(orjson.dumps(item, default=str))
        if size > max_row_bytes:
            raise RowReject("row_too_large", f"the row has {size} bytes as JSON, over --max-row-bytes {max_row_bytes}")
        return item
    try:
        item.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RowReject(
            "invalid_utf8", f"the line is not valid UTF-8 (byte {e.start}: {item[e.start : e.start + 1]!r})"
        ) from None
    try:
        return orjson.loads(item)
    except orjson.JSONDecodeError as e:
        raise RowReject("invalid_json", f"the line is not valid JSON: {e}") from None


def _reject(
    input_index: int, inp: InputFile, number: int, source: str, reject: RowReject, item: Any
) -> tuple[int, dict]:
    record = {
        "file": inp.path,
        inp.locator: number,
        "source": source,
        "reason": reject.reason,
        "message": reject.message,
        "raw": _raw_text(item),
    }
    return input_index, record


def _raw_text(item: Any) -> str:
    if isinstance(item, OversizedLine):
        text, total = item.head.decode("utf-8", "backslashreplace"), item.size
    elif isinstance(item, bytes):
        text, total = item.decode("utf-8", "backslashreplace"), len(item)
    else:
        text = orjson.dumps(item, default=str).decode()
        total = len(text)
    if len(text) > RAW_KEEP_CHARS or total > len(text):
        return text[:RAW_KEEP_CHARS] + f"...[truncated; {total} in all]"
    return text


# -- main process -------------------------------------------------------------------------------


def _chunks(inputs: list[InputFile], max_row_bytes: int, progress: Any) -> Iterator[list[tuple[int, int, Any]]]:
    rows = ((i, n, item) for i, inp in enumerate(inputs) for n, item in iter_rows(inp, max_row_bytes))
    while chunk := list(islice(rows, CHUNK_ROWS)):
        progress.update(len(chunk))
        yield chunk


@dataclass
class _Tally:
    """Everything the manifest counts, accumulated in output order."""

    inputs: list[dict]
    columns: list[Counter]
    """Per input: how many rows (objects) have each column."""
    sources: dict[str, int] = field(default_factory=dict)
    source_pairs: Counter = field(default_factory=Counter)
    source_rejects: Counter = field(default_factory=Counter)
    by_reason: Counter = field(default_factory=Counter)
    lengths: list[np.ndarray] = field(default_factory=list)
    pairs: int = 0
    truncated_prompts: int = 0
    truncated_prompt_tokens: int = 0
    max_token_id: int = 0
    first_unstable: dict | None = None
    """The first `template_not_prefix_stable` reject, in input order (an override template is refused for it)."""


def build(inputs: list[str], tokenizer_dir: str, out: str | Path, options: BuildOptions) -> BuildResult:
    """Build an attested dataset directory at `out`; see docs/data-build.md for the contract."""
    started = time.perf_counter()
    out = Path(out)
    files = _open_inputs(inputs, options)
    template = read_chat_template(options.chat_template) if options.chat_template is not None else None
    check_inputs_outside(out, inputs)
    with OutputLock(out):  # one build per output path; a second one fails fast, naming the holder
        check_replaceable(out, options.overwrite)
        tokenizer = _load_tokenizer(tokenizer_dir)
        if template is not None:  # before the attestation, so the dataset attests the template it was built with
            tokenizer.chat_template = template["text"]
        attestation = tokenizer_attestation(tokenizer)
        staging = new_staging(out)
        try:
            result = _build_into(staging, files, tokenizer, attestation, options, template)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)  # a failed build leaves nothing behind
            raise
        if result.manifest is not None:
            swap_into_place(staging, out, options.overwrite)
            result.out = out
            remove_stale_staging(out)  # earlier refused or killed builds' leftovers, kept until now for their rejects
    result.seconds = time.perf_counter() - started
    return result


def _build_into(
    staging: Path,
    files: list[InputFile],
    tokenizer: Any,
    attestation: dict,
    options: BuildOptions,
    template: dict | None,
) -> BuildResult:
    """Everything but the commit: shards, rejects and (unless refused) the manifest, all in `staging`."""
    tally = _Tally(inputs=[_input_entry(f) for f in files], columns=[Counter() for _ in files])
    writer = ShardWriter(staging, options.pairs_per_shard)
    with open(staging / REJECTS_NAME, "wb") as rejects_file, _progress(options.progress) as bar:
        for result in _run(files, tokenizer, options, bar):
            _consume(result, tally, writer, rejects_file)
    shards = [asdict(s) for s in writer.close()]
    _check_mapped_columns(tally, options)
    ignored = Counter()
    for entry, seen in zip(tally.inputs, tally.columns):
        entry["ignored_columns"] = ignored_columns(seen, options.columns)
        ignored.update(entry["ignored_columns"])
    rows_read = sum(e["rows_read"] for e in tally.inputs)
    result = BuildResult(staging, None, rows_read, tally.pairs, dict(tally.by_reason), 0.0)
    result.ignored_columns = dict(sorted(ignored.items()))
    result.error = _refusal(tally, rows_read, options, template)
    if result.error is None:
        manifest = _manifest(tally, shards, attestation, options.recorded(template), staging)
        write_manifest(staging, manifest)
        result.manifest = manifest
        result.prompt_tokens = manifest["totals"]["prompt_tokens"]
        result.completion_tokens = manifest["totals"]["completion_tokens"]
    return result


def _open_inputs(inputs: list[str], options: BuildOptions) -> list[InputFile]:
    if not inputs:
        raise DataError(
            "no INPUT given; pass one or more .jsonl, .jsonl.zst, .json, .parquet or .arrow files, or Hugging "
            "Face datasets save_to_disk directories"
        )
    if options.source is not None and len(inputs) > 1:
        raise DataError(
            f"--source {options.source!r} names the source of a single input, but {len(inputs)} inputs were given; "
            "drop --source (each input's file stem is its source) or set a 'source' field in the rows"
        )
    inputs = [local for path in inputs for local in (hub_files(path) if is_hub_input(path) else [path])]
    seen: dict[Path, str] = {}
    for path in inputs:
        resolved = Path(path).resolve()
        if resolved in seen:
            raise DataError(
                f"input {path} is given twice (also as {seen[resolved]}); its rows would be read twice: "
                "give each input once"
            )
        seen[resolved] = path
    return [open_input(path, options.source) for path in inputs]


def _load_tokenizer(tokenizer_dir: str) -> Any:
    from transformers import AutoTokenizer

    if not Path(tokenizer_dir).is_dir():
        raise DataError(f"--tokenizer {tokenizer_dir}: not a directory; pass a local Hugging Face tokenizer directory")
    try:
        return AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError) as e:
        raise DataError(f"--tokenizer {tokenizer_dir}: cannot load a tokenizer ({e})") from None


def _input_entry(f: InputFile) -> dict:
    return {
        "path": f.path,
        "format": f.format,
        "default_source": f.source,
        "bytes": sum(Path(name).stat().st_size for name in f.files),
        "sha256": _input_digest(f),
        "rows_read": 0,
        "pairs": 0,
        "rejected": 0,
    }


def _input_digest(f: InputFile) -> str:
    """A file's sha256; a directory's is that of its data files' names and sha256, in reading order."""
    if f.files == (f.path,):
        return file_digest(f.path)
    return DIGEST_PREFIX + sha256_json([[Path(name).name, file_digest(name)] for name in f.files])


def _progress(enabled: bool) -> Stage:
    """A bar counting rows on a terminal; in a log, a line at most every 30 s (rows read, elapsed)."""
    return Stage("build", enabled=enabled, unit="rows", bar=True)


def _run(files, tokenizer, options, bar) -> Iterator[ChunkResult]:
    chunks = _chunks(files, options.max_row_bytes, bar)
    if options.num_proc == 1:
        _init_worker(tokenizer, options, files)
        yield from map(_process_chunk, chunks)
        return
    # fork: workers inherit the loaded tokenizer and imported modules (initargs are not pickled), and
    # the parent never encoded anything, so the Rust thread pool was never started before the fork.
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(options.num_proc, _init_pool_worker, (tokenizer, options, files)) as pool:
        yield from pool.imap(_process_chunk, chunks, chunksize=1)


def _consume(result: ChunkResult, tally: _Tally, writer: ShardWriter, rejects_file) -> None:
    for input_index, counts in result.columns.items():
        tally.columns[input_index].update(counts)
    for input_index, record in result.rejects:
        entry = tally.inputs[input_index]
        entry["rows_read"] += 1
        entry["rejected"] += 1
        tally.by_reason[record["reason"]] += 1
        if record["reason"] == "template_not_prefix_stable" and tally.first_unstable is None:
            tally.first_unstable = record
        tally.source_rejects[record["source"]] += 1
        rejects_file.write(orjson.dumps(record) + b"\n")
    block = result.block
    for input_index in block.input_index.tolist():
        tally.inputs[input_index]["rows_read"] += 1
        tally.inputs[input_index]["pairs"] += 1
    # Source ids in order of first appearance: a pure function of the input order.
    block.source_id = np.array(
        [tally.sources.setdefault(s, len(tally.sources)) for s in result.sources], dtype=np.int32
    )
    tally.source_pairs.update(result.sources)
    tally.truncated_prompts += sum(1 for t in result.truncated if t)
    tally.truncated_prompt_tokens += sum(result.truncated)
    tally.lengths.append(block.lengths)
    tally.max_token_id = max(
        [tally.max_token_id, *(int(ids.max()) for ids in (block.prompt, block.chosen, block.rejected) if ids.size)]
    )
    tally.pairs += len(block)
    writer.add(block)


def _check_mapped_columns(tally: _Tally, options: BuildOptions) -> None:
    """A mapped column that no row of an input has is a mistyped name, not a row problem: a named error."""
    for entry, seen in zip(tally.inputs, tally.columns):
        for field_name, column in (options.columns or {}).items():
            if entry["rows_read"] and not seen[column]:
                have = ", ".join(sorted(seen)[:20]) or "none (no row is an object)"
                raise DataError(
                    f"--columns maps {field_name}={column}, but no row of input {entry['path']} has a column "
                    f"{column!r}; its rows have: {have}. Fix: map {field_name} from one of these columns"
                )


def _refusal(tally: _Tally, rows_read: int, options: BuildOptions, template: dict | None) -> str | None:
    if template is not None and tally.first_unstable is not None:
        return _unstable_template(tally, options, template)
    if tally.pairs == 0:
        return f"no pair survived: all {rows_read} rows read were rejected" if rows_read else "the inputs hold no rows"
    fraction = (rows_read - tally.pairs) / rows_read
    if options.max_reject_fraction is not None and fraction > options.max_reject_fraction:
        return (
            f"{rows_read - tally.pairs} of {rows_read} rows were rejected ({fraction:.1%}), over "
            f"--max-reject-fraction {options.max_reject_fraction}"
        )
    return None


def _unstable_template(tally: _Tally, options: BuildOptions, template: dict) -> str:
    """A template the user chose that breaks prefix stability is a bug in the template, not in the rows."""
    first = tally.first_unstable
    locator = "line" if "line" in first else "row"
    where = f"{first['file']} {locator} {first[locator]}"
    return (
        f"--chat-template {options.chat_template} is not prefix-stable on the data: "
        f"{tally.by_reason['template_not_prefix_stable']} rows were rejected as template_not_prefix_stable, the "
        f"first at {where} ({first['message']}); fix the template so that the prompt rendered with "
        "add_generation_prompt is a prefix of the prompt rendered with its completion (docs/data-build.md)"
    )


def _manifest(tally: _Tally, shards: list[dict], attestation: dict, options: dict, staging: Path) -> dict:
    lengths = np.concatenate(tally.lengths).astype(np.int64)
    prompt, chosen, rejected = lengths[:, 0], lengths[:, 1], lengths[:, 2]
    segments = np.concatenate([prompt + chosen, prompt + rejected])
    sources = [{"id": sid, "name": name, "pairs": tally.source_pairs[name]} for name, sid in tally.sources.items()]
    rejects_path = staging / REJECTS_NAME
    return {
        "format_version": MANIFEST_FORMAT_VERSION,
        "kind": "dpo-dataset",
        "fingerprint": dataset_fingerprint(attestation["fingerprint"], sources, shards, options.get("columns")),
        "producer": {"name": "dpo-toolkit", "version": __version__, "options": options},
        "tokenizer": attestation,
        "inputs": tally.inputs,
        "sources": sources,
        "shards": shards,
        "totals": {
            "rows_read": int(sum(e["rows_read"] for e in tally.inputs)),
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
