"""`dpo-data audit` and `filter`: duplicates, conflicts, near-duplicates, contamination, length bias, degenerate
pairs of built datasets, measured over their shards; a filtered dataset without the pairs named (docs/audit.md)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpo_data.audit.findings import DEGENERATE_KINDS, AuditOptions, Findings, find
from dpo_data.audit.report import AUDIT_FORMAT_VERSION, AUDIT_SCHEMA, audit_document, format_audit
from dpo_data.dataset.store import PairStore

__all__ = [
    "AUDIT_FORMAT_VERSION",
    "AUDIT_SCHEMA",
    "DEGENERATE_KINDS",
    "AuditOptions",
    "Findings",
    "audit",
    "format_audit",
]


def audit(
    dirs: list[str | Path],
    against: list[str | Path] | None = None,
    options: AuditOptions | None = None,
    progress: bool = False,
    reference: str | Path | None = None,
    reference_top: int = 20,
) -> dict[str, Any]:
    """The audit document of datasets `dirs` (one store: pair indices run over them in order), contamination
    measured against `against` (datasets of the same tokenizer), with `reference` (a precomputed reference sidecar
    of `dirs`) its margins and the `reference_top` pairs it most prefers reversed; validated against its schema."""
    from dpo_state.schema import validate

    options = options or AuditOptions()
    store = PairStore(dirs)
    other = PairStore(against) if against else None
    if other is not None and other.tokenizer_fingerprint != store.tokenizer_fingerprint:
        from dpo_data.errors import DataError

        raise DataError(
            f"--against {', '.join(map(str, against))} was built with another tokenizer than the audited datasets; "
            "their token ids cannot be compared: rebuild it with the audited datasets' tokenizer"
        )
    if reference is not None:  # checked before the passes over the shards
        from dpo_data.audit.reference import reference_margins, reference_table

        table = reference_table(store, Path(reference))
    doc = audit_document(store, find(store, other, options, progress), options, other)
    if reference is not None:
        doc["reference"] = reference_margins(store, reference, table, reference_top)
    validate(AUDIT_SCHEMA, doc, "the audit document")
    return doc
