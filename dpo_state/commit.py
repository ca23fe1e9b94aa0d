"""The commit record: the last file of a checkpoint, listing every other file with its bytes and sha256."""

from __future__ import annotations

from pathlib import Path

from dpo_state.digest import file_digest
from dpo_state.errors import DocumentError
from dpo_state.files import file_problems, read_document, write_json_atomic

COMMIT_FORMAT_VERSION = 1
COMMIT_SCHEMA = "checkpoint-commit"
COMMIT_FILE = "commit.json"


def write_commit(directory: str | Path, step: int) -> dict:
    """Hash every file under `directory` and write `commit.json` by atomic rename. From that moment
    the checkpoint exists; before it, it is incomplete and is never loaded."""
    directory = Path(directory)
    record = {"format_version": COMMIT_FORMAT_VERSION, "step": step, "files": listed_files(directory, COMMIT_FILE)}
    write_json_atomic(directory / COMMIT_FILE, record, schema=COMMIT_SCHEMA)
    return record


def read_commit(directory: str | Path) -> dict:
    """The commit record, schema-checked; raises DocumentError when missing or malformed."""
    return read_document(Path(directory) / COMMIT_FILE, COMMIT_SCHEMA, COMMIT_FORMAT_VERSION)


def commit_problems(directory: str | Path, hashes: bool = True) -> list[str]:
    """Every way the files of `directory` differ from its commit record: missing, resized, altered
    (sha256, unless `hashes` is False), outside the directory, or present but unlisted. Empty when sound."""
    directory = Path(directory)
    try:
        record = read_commit(directory)
    except DocumentError as e:
        return [str(e)]
    return listing_problems(directory, record["files"], COMMIT_FILE, "the commit record", "the checkpoint", hashes)


def listed_files(directory: Path, record_file: str) -> list[dict]:
    """Every file under `directory` but `record_file` (the record that lists them): path, bytes, sha256."""
    return [
        {"path": rel, "bytes": path.stat().st_size, "sha256": file_digest(path)}
        for rel, path in _files(directory)
        if rel != record_file
    ]


def listing_problems(
    directory: Path, files: list[dict], record_file: str, record: str, place: str, hashes: bool = True
) -> list[str]:
    """How `directory` differs from the `files` that `record` (its `record_file`) lists: missing, resized,
    altered (unless not `hashes`), outside `place`, or present but unlisted."""
    problems, listed = [], set()
    for entry in files:
        rel = entry["path"]
        listed.add(rel)
        if ".." in Path(rel).parts or Path(rel).is_absolute():
            problems.append(f"{rel}: a path outside {place}")
            continue
        problems += file_problems(directory / rel, entry["bytes"], entry["sha256"], rel, record, hashes)
    unlisted = [rel for rel, _ in _files(directory) if rel not in listed and rel != record_file]
    return problems + [f"{rel}: present but not in {record}" for rel in unlisted]


def _files(directory: Path) -> list[tuple[str, Path]]:
    return [(p.relative_to(directory).as_posix(), p) for p in sorted(directory.rglob("*")) if p.is_file()]
