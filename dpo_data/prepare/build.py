"""`dpo-data build`: raw preference rows -> tokenized pairs in Arrow shards, rejects, and a manifest written last
(or, with `--part K/N`, one task's share of them and its part.json, for `dpo-data merge`)."""

from __future__ import annotations

import multiprocessing
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass
from itertools import groupby, islice
from pathlib import Path
from typing import Any

import orjson

from dpo_data.dataset.manifest import REJECTS_NAME, ImageTally
from dpo_data.dataset.shards import ShardWriter
from dpo_data.errors import DataError
from dpo_data.prepare.chunk import ChunkResult, init_pool_worker, init_worker, process_chunk
from dpo_data.prepare.hub import hub_files, is_hub_input
from dpo_data.prepare.inputs import InputFile, iter_rows, open_input
from dpo_data.prepare.model import BuildModel, load_model
from dpo_data.prepare.options import VISION_OPTIONS, BuildOptions, pixels_without_processor
from dpo_data.prepare.output import OutputLock, check_inputs_outside, check_replaceable, commit_staged
from dpo_data.prepare.parts import Part, build_plan, existing_part, part_document, refused_part, write_part
from dpo_data.prepare.tally import BuildResult, Tally, conclude, refusal
from dpo_data.prepare.template import TEMPLATE_FAILURES, read_chat_template, render_chars, unrenderable
from dpo_data.progress import Stage
from dpo_state.digest import DIGEST_PREFIX, file_digest, sha256_json

__all__ = ["BuildOptions", "BuildResult", "build"]

CHUNK_ROWS = 256  # rows per unit of work sent to a worker, within one span
VISION_CHUNK_ROWS = 4  # a vision build's chunks carry their images' bytes back from the workers: few rows
IN_FLIGHT_PER_PROC = 2  # chunks sent to the pool and not yet written, per worker: what the build holds is bounded


def _chunks(inputs: list[InputFile], options: BuildOptions, tally: Tally, progress: Any, size: int) -> Iterator[tuple]:
    """(span, rows) of at most CHUNK_ROWS rows of one span, for the spans this build owns (all, or its
    part's); every row is read (and counted in `tally.rows_total`), a part's own rows alone are encoded."""
    for span, in_span in groupby(_numbered(inputs, options), key=lambda row: row[0] // options.pairs_per_shard):
        owned = options.part is None or options.part.owns(span)
        while batch := list(islice(in_span, size)):
            tally.rows_total += len(batch)
            progress.update(len(batch))
            if owned:
                yield span, [(i, n, g, item) for g, i, n, item in batch]


def _numbered(inputs: list[InputFile], options: BuildOptions) -> Iterator[tuple[int, int, int, Any]]:
    """(global row, input index, row number, item) of every row; a part skips turning others' rows into objects."""
    span_rows, part, row = options.pairs_per_shard, options.part, 0
    for i, inp in enumerate(inputs):

        def skip(start: int, count: int, base: int = row) -> bool:  # rows start.. (1-based) of this input
            first, last = base + start - 1, base + start + count - 2
            return not any(part.owns(span) for span in range(first // span_rows, last // span_rows + 1))

        for n, item in iter_rows(inp, options.max_row_bytes, None if part is None else skip):
            yield row, i, n, item
            row += 1


def build(
    inputs: list[str],
    tokenizer_dir: str | None,
    out: str | Path,
    options: BuildOptions,
    processor_dir: str | None = None,
) -> BuildResult:
    """Build an attested dataset directory at `out`; see docs/data-build.md for the contract. Text data is built
    with a tokenizer (`tokenizer_dir`), vision data with a processor (`processor_dir`, a model directory holding
    one): exactly one is given. What can be refused up front is, before the build's progress line starts; its
    `seconds` are the time that line ends with (from the tokenizer's load to the commit)."""
    out = Path(out)
    if (tokenizer_dir is None) == (processor_dir is None):
        raise DataError(
            "give exactly one of --tokenizer DIR (text data) and --processor DIR (data with images: a vision-language "
            "model's directory with its processor)"
        )
    for name, default in VISION_OPTIONS.items():
        if processor_dir is None and getattr(options, name) != default:
            raise pixels_without_processor(getattr(options, name), name)
    files = _open_inputs(inputs, options)
    chars = render_chars(options.max_row_bytes)
    template = read_chat_template(options.chat_template, chars) if options.chat_template is not None else None
    check_inputs_outside(out, inputs)
    if tokenizer_dir is not None and not Path(tokenizer_dir).is_dir():
        raise DataError(f"--tokenizer {tokenizer_dir}: not a directory; pass a local Hugging Face tokenizer directory")
    with OutputLock(out):  # one build per output path; a second one fails fast, naming the holder
        if options.part is None:  # at once (again before the build); a part first needs its plan, to see
            check_replaceable(out, options.overwrite)  # whether it is already built
        with _progress(options.progress) as bar:
            result = _build(files, template, tokenizer_dir, processor_dir, out, options, bar)
    result.seconds = bar.seconds
    return result


def _build(
    files: list[InputFile],
    template: dict | None,
    tokenizer_dir: str | None,
    processor_dir: str | None,
    out: Path,
    options: BuildOptions,
    bar: Stage,
) -> BuildResult:
    """Load the tokenizer (or processor), then build (or find a part already built) and commit."""
    model = load_model(tokenizer_dir, processor_dir, template)
    entries = [_input_entry(f) for f in files]
    plan = None
    if options.part is not None:
        recorded = options.recorded(template, vision=model.processor is not None)
        plan = build_plan(recorded, model.attestation, entries, options.part, model.processor_attestation)
        if (done := _finished_part(out, options.part, plan, options.overwrite)) is not None:
            return done
    return commit_staged(
        out,
        options.overwrite,
        lambda staging: _build_into(staging, files, entries, model, options, template, plan, bar),
    )


def _finished_part(out: Path, part: Part, plan: dict, overwrite: bool) -> BuildResult | None:
    """A relaunched task whose part is already built with this plan has nothing to do; another build's part
    at `out` is refused by name. With --overwrite, `out` is rebuilt whatever it holds."""
    if overwrite:  # rebuilds whatever `out` holds, a finished part of this plan too
        return None
    found = existing_part(out)
    if found is None:
        return None
    if found["plan"] == plan and found["part"]["index"] == part.index:
        counts, rows = found["counts"], sum(e["rows_read"] for e in found["inputs"])
        return BuildResult(out, None, rows, counts["pairs"], counts["by_reason"], 0.0, part=found, skipped=True)
    raise refused_part(out, found, part, plan)


def _build_into(
    staging: Path,
    files: list[InputFile],
    entries: list[dict],
    model: BuildModel,
    options: BuildOptions,
    template: dict | None,
    plan: dict | None,
    bar: Stage,
) -> BuildResult:
    """Everything but the commit: shards, rejects and (unless refused) the manifest, or a part's part.json,
    all in `staging`; `bar` counts the rows read."""
    vision = model.processor is not None
    tally = Tally(inputs=entries, columns=[Counter() for _ in files], forms=[Counter() for _ in files])
    tally.images = ImageTally() if vision else None
    writer = ShardWriter(staging, vision=vision)
    renders = _Renders()
    with open(staging / REJECTS_NAME, "wb") as rejects_file:
        for result in _run(files, model, options, tally, bar):
            _consume(result, tally, writer, rejects_file)
            renders.add(result)
    shards = writer.close()
    if template is not None:
        renders.check(options.chat_template)
    if plan is None:
        return conclude(staging, tally, shards, model.attestation, options, template, model.processor_attestation)
    result = BuildResult(staging, None, sum(e["rows_read"] for e in entries), tally.pairs, dict(tally.by_reason), 0.0)
    if template is not None and tally.first_unstable is not None:  # the merge would refuse: say so now
        result.error = refusal(tally, options, template)
        return result
    result.part = part_document(
        options.part, plan, tally, shards, model.attestation, staging, model.processor_attestation
    )
    write_part(staging, result.part)
    return result


@dataclass
class _Renders:
    """Whether the chat template rendered any row: an override that renders none cannot render the data."""

    rendered: int = 0
    failed: int = 0
    first: dict | None = None

    def add(self, result: ChunkResult) -> None:
        self.rendered += result.rendered
        for _, record in result.rejects:
            if record["reason"] in TEMPLATE_FAILURES:
                self.failed += 1
                self.first = self.first or record

    def check(self, chat_template: Any) -> None:
        """A DataError (the build commits nothing) when every row that reached the template failed in it."""
        if self.failed and not self.rendered:
            locator = "line" if "line" in self.first else "row"
            where = f"{self.first['file']} {locator} {self.first[locator]}"
            what = f"all {self.failed} rows that reached it failed"
            raise unrenderable(chat_template, what, self.first["message"], where)


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
    """The whole build's stage: a bar counting rows on a terminal; in a log, a line at most every 30 s (rows
    read, elapsed); its time is the build's."""
    return Stage("build", enabled=enabled, unit="rows", bar=True)


def _run(files, model: BuildModel, options, tally, bar) -> Iterator[ChunkResult]:
    chunks = _chunks(files, options, tally, bar, CHUNK_ROWS if model.processor is None else VISION_CHUNK_ROWS)
    if options.num_proc == 1:
        init_worker(model.tokenizer, options, files, model.processor)
        yield from map(process_chunk, chunks)
        return
    # fork: workers inherit the loaded tokenizer and imported modules (initargs are not pickled), and
    # the parent never encoded anything, so the Rust thread pool was never started before the fork.
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(options.num_proc, init_pool_worker, (model.tokenizer, options, files, model.processor)) as pool:
        yield from _in_order(pool, chunks, IN_FLIGHT_PER_PROC * options.num_proc)


def _in_order(pool: Any, chunks: Iterator[tuple], window: int) -> Iterator[ChunkResult]:
    """The chunks' results in order, at most `window` chunks read ahead or done and not yet taken (`Pool.imap` keeps
    every result that finishes before an earlier one: a slow chunk would let the others' images pile up)."""
    pending: deque = deque()
    for chunk in chunks:
        pending.append(pool.apply_async(process_chunk, (chunk,)))
        if len(pending) >= window:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


def _consume(result: ChunkResult, tally: Tally, writer: ShardWriter, rejects_file) -> None:
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
    for input_index, form in zip(block.input_index.tolist(), result.forms):
        tally.inputs[input_index]["rows_read"] += 1
        tally.inputs[input_index]["pairs"] += 1
        tally.forms[input_index][form] += 1
    for name in result.sources:  # the manifest's ids: in order of first appearance, a pure function of the input order
        tally.sources.setdefault(name, len(tally.sources))
    tally.source_pairs.update(result.sources)
    tally.truncated_prompts += sum(1 for t in result.truncated if t)
    tally.truncated_prompt_tokens += sum(result.truncated)
    tally.lengths.append(block.lengths)
    tally.max_token_id = max(
        [tally.max_token_id, *(int(ids.max()) for ids in (block.prompt, block.chosen, block.rejected) if ids.size)]
    )
    tally.pairs += len(block)
    if tally.images is not None:
        tally.images.add([len(images) for images in block.image_bytes], [len(b) for i in block.image_bytes for b in i])
    writer.add(block, result.sources, result.span)
