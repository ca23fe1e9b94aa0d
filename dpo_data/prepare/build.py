"""`dpo-data build`: raw preference rows -> tokenized pairs in Arrow shards, rejects, and a manifest written last
(or, with `--part K/N`, one task's share of them and its part.json, for `dpo-data merge`)."""

from __future__ import annotations

import multiprocessing
import os
from collections import Counter, deque
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from itertools import groupby, islice
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from dpo_data.dataset.manifest import REJECTS_NAME, ImageTally
from dpo_data.dataset.shards import PARTS, PairBlock, ShardWriter
from dpo_data.errors import DataError
from dpo_data.images import DEFAULT_MAX_IMAGE_PIXELS, DEFAULT_MAX_ROW_IMAGE_PIXELS, pil_pixel_limit
from dpo_data.prepare.columns import check_columns, rename_columns
from dpo_data.prepare.hub import hub_files, is_hub_input
from dpo_data.prepare.inputs import MAX_ROW_BYTES, InputFile, OversizedLine, iter_rows, open_input, row_size
from dpo_data.prepare.output import OutputLock, check_inputs_outside, check_replaceable, commit_staged
from dpo_data.prepare.parts import Part, build_plan, existing_part, part_document, refused_part, write_part
from dpo_data.prepare.rows import RowReject, normalize_row
from dpo_data.prepare.tally import BuildResult, Tally, conclude, refusal
from dpo_data.prepare.template import TEMPLATE_FAILURES, read_chat_template, render_chars, unrenderable
from dpo_data.prepare.tokenize import OVERLENGTH_MODES, PairEncoder, TokenizeOptions
from dpo_data.prepare.vision import VisionEncoder
from dpo_data.progress import Stage
from dpo_data.tokenizer import load_tokenizer
from dpo_state.attestation import processor_attestation, tokenizer_attestation
from dpo_state.digest import DIGEST_PREFIX, file_digest, sha256_json

__all__ = ["BuildOptions", "BuildResult", "build"]

CHUNK_ROWS = 256  # rows per unit of work sent to a worker, within one span
VISION_CHUNK_ROWS = 4  # a vision build's chunks carry their images' bytes back from the workers: few rows
IN_FLIGHT_PER_PROC = 2  # chunks sent to the pool and not yet written, per worker: what the build holds is bounded
RAW_KEEP_CHARS = 2000  # what a reject keeps of its raw row
VISION_OPTIONS = {"max_image_pixels": DEFAULT_MAX_IMAGE_PIXELS, "max_row_image_pixels": DEFAULT_MAX_ROW_IMAGE_PIXELS}
"""The options that bound images, with their defaults: a vision build's alone (given to a text build, an error)."""


@dataclass(frozen=True)
class BuildOptions:
    """Options of one build. All but `num_proc`, `overwrite` and `progress` are recorded in the manifest.

    `columns` maps row fields onto the input's column names: {"prompt": "question", ...} or the CLI's
    "prompt=question,chosen=response_j,rejected=response_k"; it is kept as a checked dict in field order.

    `chat_template` is the path of a Jinja file that replaces the tokenizer's chat template (`--chat-template`);
    the manifest records its name, sha256 and text, and the build is refused when it is not prefix-stable.

    `pairs_per_shard` rows read make a span, and each span's pairs one shard (so at most that many pairs a
    shard). `part` builds only every `part.count`-th span from the `part.index`-th, into a part directory.

    `max_image_pixels` bounds the pixels an image of a vision build (`build(..., processor_dir=...)`) may declare,
    `max_row_image_pixels` those a row's images declare together (checked before any is decoded); both are recorded
    for vision builds only."""

    max_length: int | None = None
    overlength: str = "reject"
    append_eos: bool = True
    source: str | None = None
    max_reject_fraction: float | None = None
    pairs_per_shard: int = 100_000
    max_row_bytes: int = MAX_ROW_BYTES
    columns: Mapping[str, str] | str | None = None
    chat_template: str | Path | None = None
    num_proc: int = 1
    overwrite: bool = False
    progress: bool = False
    part: Part | None = None
    max_image_pixels: int = DEFAULT_MAX_IMAGE_PIXELS
    max_row_image_pixels: int = DEFAULT_MAX_ROW_IMAGE_PIXELS

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
        # the default needs no check (below PIL's threshold, tests/vision), and a text build no PIL import
        if self.max_image_pixels != DEFAULT_MAX_IMAGE_PIXELS and not 1 <= self.max_image_pixels <= pil_pixel_limit():
            raise DataError(
                f"--max-image-pixels is {self.max_image_pixels}; allowed: 1 to {pil_pixel_limit()} (PIL's "
                "decompression-bomb threshold, above which it flags an image as a bomb whatever this says)"
            )
        if self.max_row_image_pixels < 1:
            raise DataError(
                f"--max-row-image-pixels is {self.max_row_image_pixels}; it must be at least 1 (the pixels a row's "
                f"images may declare together; default {DEFAULT_MAX_ROW_IMAGE_PIXELS})"
            )

    def recorded(self, chat_template: dict | None = None, vision: bool = False) -> dict[str, Any]:
        """The options that shape the output (recorded in the manifest; --num-proc never changes a byte), with
        the override template as `read_chat_template` read it; the `VISION_OPTIONS` for a vision build only, so a
        text build records what it always did."""
        skip = {"num_proc", "overwrite", "progress", "chat_template", "part"}
        if not vision:
            skip.update(VISION_OPTIONS)
        if self.columns is None:
            skip.add("columns")  # left out, not null: a build without a mapping records what it always did
        options = {k: v for k, v in asdict(self).items() if k not in skip}
        if chat_template is not None:  # likewise only when given
            options["chat_template"] = chat_template
        return options


# -- worker side --------------------------------------------------------------------------------

_worker: dict[str, Any] = {}


def _init_worker(tokenizer: Any, options: BuildOptions, inputs: list[InputFile], processor: Any = None) -> None:
    """Set up this process's encoders (the build process itself, or a forked pool worker)."""
    topts = TokenizeOptions(options.max_length, options.overlength, options.append_eos, options.max_row_bytes)
    encoder = PairEncoder(tokenizer, topts, override=options.chat_template)
    vision = None
    if processor is not None:
        vision = VisionEncoder(encoder, processor, options.max_image_pixels, options.max_row_image_pixels)
    _worker.update(encoder=encoder, vision=vision, options=options, inputs=inputs)


@dataclass
class ChunkResult:
    """A worker's output for one chunk (rows of one span): its pairs as a block (source ids not yet assigned),
    the source name and truncated-prompt count of each pair, and its rejects, all in input order."""

    span: int
    block: PairBlock
    sources: list[str]
    truncated: list[int]
    rejects: list[tuple[int, dict]]
    columns: dict[int, Counter]
    """Per input index: how many of the chunk's rows (objects) have each column."""
    rendered: int = 0
    """Rows of the chunk whose renderings the chat template made."""
    forms: list[str] = field(default_factory=list)
    """The row form of each pair (`rows.FORMS`), in input order."""


def _init_pool_worker(tokenizer: Any, options: BuildOptions, inputs: list[InputFile], processor: Any) -> None:
    """One pool worker per core: its Rust tokenizer stays single-threaded, or N workers would each
    start a thread per core and fight over them (measured: 20% more CPU time at 2 workers)."""
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _init_worker(tokenizer, options, inputs, processor)


def _process_chunk(chunk: tuple[int, list[tuple[int, int, int, Any]]]) -> ChunkResult:
    """Parse, validate and encode a chunk of rows: (span, [(input index, row number, global row, item)])."""
    inputs, options, encoder = _worker["inputs"], _worker["options"], _worker["encoder"]
    rejects, pairs, where, columns = [], [], [], {}
    span, rows = chunk
    for input_index, number, row_index, item in rows:
        inp = inputs[input_index]
        row = None
        try:
            row = _parse(item, options.max_row_bytes)
            if isinstance(row, dict):
                columns.setdefault(input_index, Counter()).update(row.keys())
            pairs.append(normalize_row(rename_columns(row, options.columns) if options.columns else row))
            where.append((input_index, number, row_index, item))
        except RowReject as reject:
            rejects.append(_reject(input_index, inp, number, _row_source(row, inp), reject, item))
    kept, sources, forms, truncated, ids = [], [], [], [], {part: [] for part in PARTS}
    images = None if _worker["vision"] is None else []
    before = encoder.rendered_rows
    results = _encode(pairs, [(inputs[i], n) for i, n, _, _ in where])
    for (input_index, number, row_index, item), pair, encoded in zip(where, pairs, results):
        source = pair.source or inputs[input_index].source
        if isinstance(encoded, RowReject):
            rejects.append(_reject(input_index, inputs[input_index], number, source, encoded, item))
            continue
        lengths = (len(encoded.prompt), len(encoded.chosen), len(encoded.rejected))
        kept.append((input_index, number, row_index, pair.id, *lengths))
        sources.append(source)
        forms.append(pair.form)
        truncated.append(encoded.truncated_prompt_tokens)
        for part in PARTS:
            ids[part].extend(getattr(encoded, part))
        if images is not None:
            images.append(encoded.images)
    rejects.sort(key=lambda r: (r[0], r[1][inputs[r[0]].locator]))  # input order, whichever stage rejected
    rendered = encoder.rendered_rows - before
    return ChunkResult(span, _block(kept, ids, images), sources, truncated, rejects, columns, rendered, forms)


def _encode(pairs: list, places: list[tuple[InputFile, int]]) -> list:
    """Each pair's `EncodedPair` or `RowReject`: by the text encoder, or in a vision build by the vision encoder
    (every conversation). A text build refuses a row with images by name (a `DataError`) and rejects content
    given as parts."""
    encoder, vision = _worker["encoder"], _worker["vision"]
    results: list[Any] = [None] * len(pairs)
    text = []
    for i, (pair, (inp, number)) in enumerate(zip(pairs, places)):
        if vision is None and pair.images:
            raise _images_need_processor(pair, inp, number)
        if vision is None and pair.vision:
            results[i] = RowReject(
                "wrong_type",
                "a message's content is a list of parts, which only a vision build reads: write each content as a "
                "string, or build with --processor DIR (a vision-language model's processor)",
            )
        elif vision is None or pair.kind == "text":
            text.append(i)
        else:
            try:
                results[i] = vision.encode(pair, inp)
            except RowReject as reject:
                results[i] = reject
    for i, result in zip(text, encoder.encode_many([pairs[i] for i in text])):
        results[i] = result
    return results


def _images_need_processor(pair: Any, inp: InputFile, number: int) -> DataError:
    return DataError(
        f"{inp.path} {inp.locator} {number} has {len(pair.images)} images, but the build was given a tokenizer "
        "(--tokenizer), which cannot read them; build vision data with --processor DIR, the model directory holding "
        "the vision-language model's processor (docs/data-build.md, vision pairs)"
    )


def _block(kept: list[tuple], ids: dict[str, list[int]], images: list | None = None) -> PairBlock:
    return PairBlock(
        source_id=np.zeros(len(kept), dtype=np.int32),
        row_index=np.array([k[2] for k in kept], dtype=np.int64),
        input_index=np.array([k[0] for k in kept], dtype=np.int32),
        input_row=np.array([k[1] for k in kept], dtype=np.int64),
        lengths=np.array([k[4:] for k in kept], dtype=np.int32).reshape(-1, 3),
        row_id=[k[3] for k in kept],
        **{part: np.array(ids[part], dtype=np.int32) for part in PARTS},
        image_bytes=None if images is None else [[data for data, _ in pair] for pair in images],
        image_sha256=None if images is None else [[digest for _, digest in pair] for pair in images],
    )


def _row_source(row: Any, inp: InputFile) -> str:
    """The source a rejected row is counted under: its own valid 'source' field, else its input's."""
    own = row.get("source") if isinstance(row, dict) else None
    return own if isinstance(own, str) and own.strip() else inp.source


def _parse(item: Any, max_row_bytes: int) -> Any:
    if isinstance(item, OversizedLine):
        raise RowReject("row_too_large", f"the row has {item.size} bytes, over --max-row-bytes {max_row_bytes}")
    if not isinstance(item, bytes):  # .json / .parquet rows arrive parsed
        size = row_size(item)
        if size > max_row_bytes:
            raise RowReject(
                "row_too_large",
                f"the row has {size} bytes (its JSON, a binary value counted by its length), over --max-row-bytes "
                f"{max_row_bytes}",
            )
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


def pixels_without_processor(value: int, name: str = "max_image_pixels") -> DataError:
    """An image bound (`VISION_OPTIONS`, by its field name) given to a text build, which has no images to bound (it
    would be ignored)."""
    option = "--" + name.replace("_", "-")
    return DataError(
        f"{option} {value}: it applies only to a vision build (--processor DIR), and this build is a text "
        f"build (--tokenizer DIR); drop {option}, or build data with images with --processor DIR"
    )


@dataclass(frozen=True)
class _Model:
    """What a build encodes with: the tokenizer and, for a vision build, the processor, with their attestations."""

    tokenizer: Any
    attestation: dict
    processor: Any = None
    processor_attestation: dict | None = None


def _load_model(tokenizer_dir: str | None, processor_dir: str | None, template: dict | None) -> _Model:
    """The tokenizer (a vision build's: the processor's, with the processor's chat template), the override
    template in place (before the attestation, so the dataset attests the template it was built with)."""
    from dpo_data.processor import load_processor, rendering_tokenizer

    processor = None if processor_dir is None else load_processor(processor_dir)
    tokenizer = _load_tokenizer(tokenizer_dir) if processor is None else rendering_tokenizer(processor)
    if template is not None:
        tokenizer.chat_template = template["text"]
    attestation = tokenizer_attestation(tokenizer)
    if processor is None:
        return _Model(tokenizer, attestation)
    return _Model(tokenizer, attestation, processor, processor_attestation(processor, attestation))


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
    model = _load_model(tokenizer_dir, processor_dir, template)
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
    model: _Model,
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


def _load_tokenizer(tokenizer_dir: str) -> Any:
    try:
        return load_tokenizer(tokenizer_dir)
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
    """The whole build's stage: a bar counting rows on a terminal; in a log, a line at most every 30 s (rows
    read, elapsed); its time is the build's."""
    return Stage("build", enabled=enabled, unit="rows", bar=True)


def _run(files, model: _Model, options, tally, bar) -> Iterator[ChunkResult]:
    chunks = _chunks(files, options, tally, bar, CHUNK_ROWS if model.processor is None else VISION_CHUNK_ROWS)
    if options.num_proc == 1:
        _init_worker(model.tokenizer, options, files, model.processor)
        yield from map(_process_chunk, chunks)
        return
    # fork: workers inherit the loaded tokenizer and imported modules (initargs are not pickled), and
    # the parent never encoded anything, so the Rust thread pool was never started before the fork.
    ctx = multiprocessing.get_context("fork")
    with ctx.Pool(options.num_proc, _init_pool_worker, (model.tokenizer, options, files, model.processor)) as pool:
        yield from _in_order(pool, chunks, IN_FLIGHT_PER_PROC * options.num_proc)


def _in_order(pool: Any, chunks: Iterator[tuple], window: int) -> Iterator[ChunkResult]:
    """The chunks' results in order, at most `window` chunks read ahead or done and not yet taken (`Pool.imap` keeps
    every result that finishes before an earlier one: a slow chunk would let the others' images pile up)."""
    pending: deque = deque()
    for chunk in chunks:
        pending.append(pool.apply_async(_process_chunk, (chunk,)))
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
