"""Identity and persistence: attestations, schemas, file helpers, checkpoint state. The lowest layer; imports
no other project package.

The public API (names are imported on first use):

    from dpo_state import ToolkitError, tokenizer_attestation, read_document, verify_checkpoint
"""

from __future__ import annotations

from dpo_state.lazy import lazy_exports

_PUBLIC = {
    # the one error family
    "ToolkitError": "dpo_state.errors",
    "DocumentError": "dpo_state.errors",
    "SchemaError": "dpo_state.errors",
    "StateError": "dpo_state.errors",
    "AttestationError": "dpo_state.errors",
    # tokenizer attestation v2
    "tokenizer_attestation": "dpo_state.attestation",
    "tokenizer_fingerprint": "dpo_state.attestation",
    # digests, documents and files
    "file_digest": "dpo_state.digest",
    "sha256_json": "dpo_state.digest",
    "read_json": "dpo_state.files",
    "read_document": "dpo_state.files",
    "write_json_atomic": "dpo_state.files",
    "file_problems": "dpo_state.files",
    "validate": "dpo_state.schema",
    "schema_problems": "dpo_state.schema",
    # checkpoints
    "inspect_checkpoint": "dpo_state.audit",
    "diff_checkpoints": "dpo_state.audit",
    "verify_checkpoint": "dpo_state.audit",
}

__all__ = list(_PUBLIC)


__getattr__, __dir__ = lazy_exports("dpo_state", globals(), _PUBLIC)
