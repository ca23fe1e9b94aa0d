"""File helpers for every persisted document: bounded JSON reads, atomic writes, the one integrity check."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import orjson

from dpo_state.digest import file_digest
from dpo_state.errors import DocumentError

MAX_JSON_BYTES = 64 << 20  # our documents are KBs to a few MBs; a larger one is hostile or broken


def read_json(path: str | Path, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """Parse a JSON file that may be hostile: size-limited, a pickle refused unread, errors named."""
    path = Path(path)
    if not path.is_file():
        raise DocumentError(f"{path} is missing")
    size = path.stat().st_size
    if size > max_bytes:
        raise DocumentError(f"{path} is {size} bytes, over the {max_bytes}-byte limit for this document")
    data = path.read_bytes()
    if data[:1] == b"\x80":  # the pickle protocol opcode: refuse to look further
        raise DocumentError(f"{path} is a pickle, not JSON; these files are JSON only and are never unpickled")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise DocumentError(f"{path} is not valid JSON ({e}); the file is truncated or corrupted") from None


def read_document(
    path: str | Path,
    schema: str,
    version: int,
    max_bytes: int = MAX_JSON_BYTES,
    fix: str = "use the version of dpo-toolkit that wrote it",
) -> Any:
    """A JSON document of `format_version` `version`, checked against `schemas/<schema>.schema.json`.

    The version is checked first, so a document of another version is reported as such (with `fix`)
    rather than as a list of schema violations.
    """
    from dpo_state.schema import schema_problems

    document = read_json(path, max_bytes)
    found = document.get("format_version") if isinstance(document, dict) else None
    if isinstance(found, int) and found != version:
        raise DocumentError(
            f"{path} has format_version {found}; this version of dpo-toolkit reads {version}. Fix: {fix}"
        )
    problems = schema_problems(schema, document)
    if problems:
        raise DocumentError(f"{path} does not match schemas/{schema}.schema.json:\n  - " + "\n  - ".join(problems))
    return document


def write_json_atomic(path: str | Path, document: Any, schema: str | None = None) -> None:
    """Write `path` via a temporary file, fsync and rename: readers see the old file or the whole new one.
    With `schema`, the document is validated first and nothing is written when it does not match."""
    if schema is not None:
        from dpo_state.schema import validate

        validate(schema, document, str(path))
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp")
    try:
        with open(tmp, "wb") as f:
            f.write(orjson.dumps(document, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS) + b"\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(OSError):  # a full disk leaves no half-written file beside the document
            tmp.unlink(missing_ok=True)
        if isinstance(e, OSError) and e.filename is None:  # a failed write names no file: the document is the one
            raise OSError(e.errno, e.strerror, str(path)) from e
        raise
    fsync_dir(path.parent)


def fsync_dir(path: str | Path) -> None:
    """Make a rename inside directory `path` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def file_problems(path: str | Path, size: int, digest: str, label: str, record: str, hashes: bool = True) -> list[str]:
    """How a file differs from what `record` (e.g. "the manifest") says of it: missing, another size,
    or another `sha256:<hex>` digest (skipped when `hashes` is False). Empty when it matches."""
    path = Path(path)
    if not path.is_file():
        return [f"{label}: missing"]
    actual = path.stat().st_size
    if actual != size:
        return [f"{label}: {actual} bytes, {record} says {size} (truncated or appended to)"]
    if hashes and file_digest(path) != digest:
        return [f"{label}: sha256 differs from {record} (corrupted or replaced)"]
    return []
