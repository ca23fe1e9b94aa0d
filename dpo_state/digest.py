"""Content digests: sha256 of files and of canonical JSON, the hashing used by every attestation."""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import orjson

_CHUNK = 1 << 20


DIGEST_PREFIX = "sha256:"
"""Every file digest the project writes (manifests, commit records, sidecars) is spelled `sha256:<hex>`."""


def file_digest(path: str | Path) -> str:
    """`sha256:<hex>` of a file's bytes, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return DIGEST_PREFIX + h.hexdigest()


def bytes_digest(data: bytes) -> str:
    """`sha256:<hex>` of bytes held in memory, spelled as `file_digest` spells a file's."""
    return DIGEST_PREFIX + hashlib.sha256(data).hexdigest()


def canonical_json(value: Any) -> bytes:
    """Canonical JSON bytes: sorted keys, no whitespace, UTF-8; the form every fingerprint hashes."""
    return orjson.dumps(value, option=orjson.OPT_SORT_KEYS | orjson.OPT_NON_STR_KEYS)


def sha256_json(value: Any) -> str:
    """Hex sha256 of `canonical_json(value)`."""
    return hashlib.sha256(canonical_json(value)).hexdigest()
