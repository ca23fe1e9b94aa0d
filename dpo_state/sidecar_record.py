"""reference.json: the document of a precomputed reference sidecar, read by the trainer and the report alike."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpo_state.files import read_document

SIDECAR_FORMAT_VERSION = 1
SIDECAR_SCHEMA = "reference-sidecar"
SIDECAR_DOCUMENT = "reference.json"
SIDECAR_TABLE = "logps.safetensors"
MAX_DOCUMENT_BYTES = 1 << 20  # the document is small; a larger file is refused before parsing


def read_sidecar_record(directory: str | Path) -> Any:
    """The sidecar's reference.json, schema-checked (never unpickled); a DocumentError when malformed."""
    return read_document(
        Path(directory) / SIDECAR_DOCUMENT,
        SIDECAR_SCHEMA,
        SIDECAR_FORMAT_VERSION,
        MAX_DOCUMENT_BYTES,
        fix="recompute it with this version",
    )
