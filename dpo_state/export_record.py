"""export.json: the last file of an export (final/, final-merged/), listing every other file with bytes and sha256."""

from __future__ import annotations

from pathlib import Path

from dpo_state.commit import listed_files, listing_problems
from dpo_state.errors import DocumentError
from dpo_state.files import read_document, write_json_atomic

EXPORT_FORMAT_VERSION = 1
EXPORT_SCHEMA = "export-manifest"
EXPORT_FILE = "export.json"


def write_export_record(directory: str | Path, step: int, run_id: str) -> dict:
    """Hash every file of the export `directory` and write its `export.json` (atomic rename): the record
    `dpo-state verify` checks a copied or downloaded export against."""
    directory = Path(directory)
    record = {
        "format_version": EXPORT_FORMAT_VERSION,
        "step": step,
        "run_id": run_id,
        "files": listed_files(directory, EXPORT_FILE),
    }
    write_json_atomic(directory / EXPORT_FILE, record, schema=EXPORT_SCHEMA)
    return record


def read_export_record(directory: str | Path) -> dict:
    """The export record, schema-checked; raises DocumentError when missing or malformed."""
    return read_document(Path(directory) / EXPORT_FILE, EXPORT_SCHEMA, EXPORT_FORMAT_VERSION)


def export_problems(directory: str | Path) -> list[str]:
    """Every way the files of the export `directory` differ from its export.json: missing, resized,
    altered, outside it, or present but unlisted. Empty when sound."""
    directory = Path(directory)
    try:
        record = read_export_record(directory)
    except DocumentError as e:
        return [str(e)]
    return listing_problems(directory, record["files"], EXPORT_FILE, EXPORT_FILE, "the export")
