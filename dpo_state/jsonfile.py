"""Read untrusted JSON files safely: bounded size, parse errors named, never anything executable."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import orjson

MAX_JSON_BYTES = 64 << 20  # state files are KBs; a larger one is hostile or broken


class StateFileError(ValueError):
    """A state file that is missing, oversized, truncated or malformed; the message names the file."""


def read_json(path: str | Path, max_bytes: int = MAX_JSON_BYTES) -> Any:
    path = Path(path)
    if not path.is_file():
        raise StateFileError(f"{path} is missing")
    size = path.stat().st_size
    if size > max_bytes:
        raise StateFileError(f"{path} is {size} bytes, over the {max_bytes}-byte limit for a state file")
    data = path.read_bytes()
    if data[:1] == b"\x80":  # the pickle protocol opcode: refuse to look further
        raise StateFileError(f"{path} is a pickle, not JSON; state files are JSON only and are never unpickled")
    try:
        return orjson.loads(data)
    except orjson.JSONDecodeError as e:
        raise StateFileError(f"{path} is not valid JSON ({e}); the file is truncated or corrupted") from None


def read_document(path: str | Path, schema: str, version: int) -> Any:
    """A JSON document checked against `schemas/<schema>.schema.json` and its format version."""
    from dpo_state.schema import schema_problems

    document = read_json(path)
    problems = schema_problems(schema, document)
    if problems:
        raise StateFileError(f"{path} does not match schemas/{schema}.schema.json:\n  - " + "\n  - ".join(problems))
    if document["format_version"] != version:
        raise StateFileError(f"{path} has format_version {document['format_version']}; this version of dpo-toolkit "
                             f"reads {version}: use the version that wrote it")
    return document


def write_json_atomic(path: str | Path, document: Any) -> None:
    """Write `path` via a temporary file, fsync and rename: readers see the old file or the whole new one."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(orjson.dumps(document, option=orjson.OPT_INDENT_2 | orjson.OPT_SORT_KEYS))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def fsync_dir(path: str | Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
