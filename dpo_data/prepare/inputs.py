"""Read input files (.jsonl, .jsonl.zst, .json, .parquet, .arrow) and Hugging Face `save_to_disk` directories into
numbered raw rows; a broken file is a named error."""

from __future__ import annotations

import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson
import zstandard

from dpo_data.errors import DataError, InputFileError

FORMATS = {
    ".jsonl": "jsonl",
    ".jsonl.zst": "jsonl.zst",
    ".jsonl.zstd": "jsonl.zst",
    ".json": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
HF_DATASET = "hf-dataset"
"""A `datasets.Dataset.save_to_disk` directory: state.json lists its Arrow files, read in that order."""
MAX_ROW_BYTES = 8 << 20
"""The default --max-row-bytes: a longer row is rejected as row_too_large."""
_READ_CHUNK = 1 << 20
MAX_JSON_INPUT_BYTES = 1 << 30
"""A .json input is one array, parsed whole (several times its size in memory): larger data is .jsonl."""
_FEED_BYTES = 256  # compressed bytes per zstd decompress call: bounds its output (see _ZstdFrames)
_BOM = b"\xef\xbb\xbf"  # a UTF-8 byte-order mark at the start of a file
_HEAD_BYTES = 1024  # what a reject keeps of a row too large to hold
ARROW_BATCH_ROWS = 1024
"""Rows per batch read from a .parquet input (an Arrow file's batches are as written), at most."""
ROWS_BYTES = 64 << 20
"""What a .parquet or .arrow input holds decoded at a time (a batch's Arrow bytes; one row at least): rows with
inline images make fewer rows a batch, and are turned into Python objects a slice of a batch at a time."""
Skip = Callable[[int, int], bool]
"""skip(first, count): whether rows first..first+count-1 (1-based) are all rows this build does not own."""


@dataclass(frozen=True)
class InputFile:
    """One input of a build: the path as given, its format and the source name its rows default to."""

    path: str
    format: str
    source: str
    files: tuple[str, ...] = ()
    """What is read, in order: the path itself, or a `save_to_disk` directory's Arrow files."""

    @property
    def locator(self) -> str:
        """'line' for line-oriented formats, 'row' for the others: what a reject's number counts."""
        return "line" if self.format in ("jsonl", "jsonl.zst") else "row"


def detect_format(path: str) -> str:
    """The input format named by the file's suffix."""
    name = Path(path).name.lower()
    for suffix in sorted(FORMATS, key=len, reverse=True):
        if name.endswith(suffix):
            return FORMATS[suffix]
    raise DataError(
        f"input {path}: unknown file type; allowed suffixes are {', '.join(sorted(FORMATS))}. "
        "Fix: rename the file or convert it to one of these formats"
    )


def source_name(path: str) -> str:
    """Default source name of an input: its file name without the format suffix."""
    name = Path(path).name
    lowered = name.lower()
    for suffix in sorted(FORMATS, key=len, reverse=True):
        if lowered.endswith(suffix):
            return name[: -len(suffix)]
    return name


def open_input(path: str, source: str | None = None) -> InputFile:
    """Check that `path` is a readable file of a known format (or a `save_to_disk` directory) and describe it."""
    p = Path(path)
    if p.is_dir():
        return InputFile(path=path, format=HF_DATASET, source=source or p.name, files=_saved_files(p))
    fmt = detect_format(path)
    if not p.is_file():
        raise InputFileError(path, "no such file" if not p.exists() else "not a regular file")
    try:
        with open(p, "rb"):
            pass
    except OSError as e:
        raise InputFileError(path, f"cannot be opened ({e.strerror})") from None
    return InputFile(path=path, format=fmt, source=source or source_name(path), files=(path,))


def _saved_files(directory: Path) -> tuple[str, ...]:
    """The Arrow files of a `save_to_disk` directory, from its state.json; anything else is a named error."""
    state = directory / "state.json"
    if (directory / "dataset_dict.json").is_file():
        splits = sorted(d.name for d in directory.iterdir() if (d / "state.json").is_file())
        raise InputFileError(
            str(directory),
            f"a DatasetDict of splits ({', '.join(splits)}); pass one split's directory, e.g. {directory / splits[0]}"
            if splits
            else "a DatasetDict without split directories",
        )
    if not state.is_file():
        raise InputFileError(
            str(directory),
            "a directory without state.json; a directory input must be a Hugging Face datasets save_to_disk "
            "directory (or pass its .arrow / .parquet files)",
        )
    try:
        names = [entry["filename"] for entry in orjson.loads(state.read_bytes())["_data_files"]]
    except (orjson.JSONDecodeError, KeyError, TypeError) as e:
        raise InputFileError(str(directory), f"state.json does not list _data_files[].filename ({e!r})") from None
    files = []
    for name in names:
        f = directory / str(name)
        if Path(str(name)).name != name or not f.is_file():
            raise InputFileError(str(directory), f"state.json lists data file {name!r}, which is not a file in it")
        files.append(str(f))
    return tuple(files)


def iter_rows(inp: InputFile, max_row_bytes: int, skip: Skip | None = None) -> Iterator[tuple[int, Any]]:
    """Yield (number, item) for every row of `inp`, in file order, numbers 1-based.

    For line formats the item is the line's bytes (parsed later, in a worker) or, for a line over
    `max_row_bytes`, an `OversizedLine`; for .json and .parquet it is the parsed row. With `skip`, the rows of an
    Arrow or Parquet batch that `skip` says are all another part's come as None, never turned into Python
    objects (a `--part` build reads every row, and converting them is most of what that costs).
    """
    try:
        if inp.format == "jsonl":
            with open(inp.path, "rb") as f:
                yield from _lines(inp.path, f, max_row_bytes)
        elif inp.format == "jsonl.zst":
            with open(inp.path, "rb") as f:
                reader = io.BufferedReader(_ZstdFrames(inp.path, f), buffer_size=_READ_CHUNK)
                yield from _lines(inp.path, reader, max_row_bytes)
        elif inp.format == "json":
            yield from _json_array(inp.path)
        elif inp.format == "parquet":
            yield from _parquet(inp.path, skip)
        else:
            yield from _arrow_rows(inp.files, skip)
    except InputFileError:
        raise
    except (OSError, zstandard.ZstdError) as e:
        raise InputFileError(inp.path, f"read failed: {e}") from None


def row_size(row: Any) -> int:
    """What a parsed row (.json, .parquet, .arrow) counts toward --max-row-bytes: its JSON, with each binary value
    (an image's bytes) counted by its length, as a JSON line's size counts what it holds. (Measured by its repr, a
    binary value counted about 3.5 times its size: a 2.4 MB photo was a row_too_large reject.)"""
    binary: list[int] = []

    def as_null(value: Any) -> Any:  # orjson asks for what JSON cannot hold: bytes become null, measured apart
        if isinstance(value, (bytes, bytearray, memoryview)):
            binary.append(memoryview(value).nbytes)
            return None
        return str(value)

    return len(orjson.dumps(row, default=as_null)) + sum(n - len(b"null") for n in binary)


@dataclass(frozen=True)
class OversizedLine:
    """A line longer than the row-size limit: only its size and head are kept, never the whole line."""

    size: int
    head: bytes


def _lines(path: str, f: Any, max_row_bytes: int) -> Iterator[tuple[int, Any]]:
    number = 0
    while True:
        line = f.readline(max_row_bytes + 1)
        if not line:
            return
        number += 1
        if number == 1 and line.startswith(_BOM):  # some editors write one; it is not part of the first row
            line = line[len(_BOM) :]
        if len(line) > max_row_bytes and not line.endswith(b"\n"):
            size, head = len(line), line[:_HEAD_BYTES]
            while not line.endswith(b"\n"):  # skip the rest of the line without holding it
                line = f.readline(_READ_CHUNK)
                if not line:
                    break
                size += len(line)
            yield number, OversizedLine(size=size - line.endswith(b"\n"), head=head)
            continue
        if not line.endswith(b"\n"):
            _check_last_line(path, number, line)
        if line.strip():  # blank lines are not rows; they still count so later rows report their true line
            yield number, line.rstrip(b"\r\n")


def _check_last_line(path: str, number: int, line: bytes) -> None:
    """A final line without newline that does not parse is a cut-off file, not a bad row."""
    if not line.strip():
        return
    try:
        orjson.loads(line)
    except orjson.JSONDecodeError:
        raise InputFileError(
            path, f"truncated: line {number} has no newline and is not valid JSON (the file was cut off)"
        ) from None


class _ZstdFrames(io.RawIOBase):
    """Raw stream over every frame of a zstd file that fails on a cut-off frame, in bounded memory.

    `ZstdDecompressor().decompress()` stops after the first frame, and `stream_reader` (bounded, and
    across frames) ends silently inside a truncated one; a `decompressobj` reports both (`eof`), but
    returns all the output of what it is fed. So it is fed `_FEED_BYTES` at a time: zstd's densest
    block (RLE, 4 bytes) holds 128 KiB, so one feed yields at most 8 MiB, however long the line.
    """

    def __init__(self, path: str, f: Any):
        self._path, self._f = path, f
        self._dctx = zstandard.ZstdDecompressor()
        self._obj = self._dctx.decompressobj()
        self._in_frame = False
        self._input = memoryview(b"")  # read from the file, not yet fed
        self._next_frame = b""  # fed past the end of a frame: the next frame's start
        self._out = memoryview(b"")  # decompressed, not yet read; sliced as a view, never copied

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._out:
            if not self._decompress_some():
                return 0
        n = min(len(buffer), len(self._out))
        buffer[:n] = self._out[:n]
        self._out = self._out[n:]
        return n

    def _decompress_some(self) -> bool:
        """Feed the decompressor at most `_FEED_BYTES`; False at the end of the file."""
        if self._next_frame:
            piece, self._next_frame = self._next_frame, b""
        else:
            if not self._input:
                self._input = memoryview(self._f.read(_READ_CHUNK))
            if not self._input:
                if self._in_frame:
                    raise InputFileError(self._path, "truncated: the last zstd frame is incomplete")
                return False
            piece, self._input = self._input[:_FEED_BYTES], self._input[_FEED_BYTES:]
        self._out = memoryview(self._obj.decompress(piece))
        self._in_frame = True
        if self._obj.eof:
            self._next_frame = self._obj.unused_data  # at most one piece: never a copy of the whole input
            self._obj = self._dctx.decompressobj()
            self._in_frame = False
        return True


def _json_array(path: str) -> Iterator[tuple[int, Any]]:
    size = Path(path).stat().st_size
    if size > MAX_JSON_INPUT_BYTES:
        raise InputFileError(
            path,
            f"{size} bytes, over the {MAX_JSON_INPUT_BYTES}-byte limit for a .json input (one array, parsed "
            "whole); write it as JSON lines (.jsonl or .jsonl.zst), which are read row by row",
        )
    data = Path(path).read_bytes().removeprefix(_BOM)
    try:
        rows = orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise InputFileError(path, f"not valid JSON ({e}); a .json input is one array of rows") from None
    if not isinstance(rows, list):
        raise InputFileError(path, f"top-level value is {type(rows).__name__}; a .json input must be an array of rows")
    yield from enumerate(rows, start=1)


def _parquet(path: str, skip: Skip | None) -> Iterator[tuple[int, Any]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        meta = pq.read_metadata(path)
        groups = [meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)]
        rows = max(1, ROWS_BYTES * meta.num_rows // max(1, sum(groups)))  # from the rows' average decoded size
        # a row group larger than that is asked for a buffer at a time (pyarrow still holds much of it: data-build.md)
        reader = pq.ParquetFile(path, buffer_size=_READ_CHUNK if max(groups, default=0) > ROWS_BYTES else 0)
        yield from _batch_rows(reader.iter_batches(batch_size=min(rows, ARROW_BATCH_ROWS)), skip)
    except (pa.ArrowException, UnicodeDecodeError) as e:
        raise InputFileError(path, f"corrupt or unreadable parquet ({e})") from None


def _arrow_rows(files: tuple[str, ...], skip: Skip | None) -> Iterator[tuple[int, Any]]:
    """Rows of Arrow files, numbered across them: the stream format `datasets` writes, or the IPC file format."""
    yield from _batch_rows((batch for path in files for batch in _arrow_batches(path)), skip)


def _batch_rows(batches: Iterator[Any], skip: Skip | None) -> Iterator[tuple[int, Any]]:
    """The rows of `batches`, numbered; a batch over ROWS_BYTES is turned into Python objects a slice at a time."""
    number = 0
    for batch in batches:
        if skip is not None and skip(number + 1, batch.num_rows):
            slices = [[None] * batch.num_rows]
        else:
            step = max(1, batch.num_rows * ROWS_BYTES // max(1, batch.nbytes))
            slices = (batch.slice(start, step).to_pylist() for start in range(0, batch.num_rows, step))
        for rows in slices:
            for row in rows:
                number += 1
                yield number, row


def _arrow_batches(path: str) -> Iterator[Any]:
    import pyarrow as pa

    try:
        with pa.memory_map(path) as source:
            try:
                reader = pa.ipc.open_stream(source)
            except pa.ArrowInvalid:
                source.seek(0)
                reader = pa.ipc.open_file(source)
                yield from (reader.get_batch(i) for i in range(reader.num_record_batches))
                return
            yield from reader
    except (pa.ArrowException, UnicodeDecodeError) as e:
        raise InputFileError(path, f"corrupt or unreadable Arrow ({e})") from None
