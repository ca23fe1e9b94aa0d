"""The input's columns: a mapping onto the row fields a build reads (`--columns`), and the columns it ignores."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from dpo_data.errors import DataError
from dpo_data.prepare.rows import RowReject

FIELDS = ("prompt", "chosen", "rejected", "id", "source", "tools", "images", "image")
"""The row fields a build reads (docs/data-build.md, row formats); every other column is ignored."""
_REQUIRED = ("chosen", "rejected")
_EXAMPLE = "--columns prompt=question,chosen=response_j,rejected=response_k"


def parse_columns(spec: str) -> dict[str, str]:
    """`prompt=question,chosen=response_j` as {field: column}; a malformed item is a named `DataError`. `FIELD=` maps a
    field from no column (""): `prompt=` drops a file's prompt column, so chosen and rejected are read alone."""
    mapping: dict[str, str] = {}
    for item in spec.split(","):
        field, sep, column = (part.strip() for part in item.partition("="))
        if not sep or not field:
            raise DataError(
                f"--columns item {item.strip()!r} is not FIELD=COLUMN; write comma-separated FIELD=COLUMN items "
                f"(FIELD= to read a field from no column), e.g. {_EXAMPLE}"
            )
        if field in mapping:
            raise DataError(
                f"--columns names field {field!r} twice ({field}={mapping[field]} and {field}={column}); "
                "map each field from one column"
            )
        mapping[field] = column
    return mapping


def check_columns(columns: Mapping[str, str] | str) -> dict[str, str]:
    """A mapping {field: column} checked and in canonical (field) order; a bad one is a named `DataError`."""
    mapping = parse_columns(columns) if isinstance(columns, str) else dict(columns)
    mapping = {field: "" if column is None else column for field, column in mapping.items()}  # None: no column
    for field, column in mapping.items():
        if field not in FIELDS:
            raise DataError(
                f"--columns maps unknown field {field!r} (from column {column!r}); the fields a build reads are "
                f"{', '.join(FIELDS)}. Fix: map one of them, e.g. {_EXAMPLE}"
            )
        if not isinstance(column, str):
            raise DataError(f"--columns maps field {field!r} from {column!r}; a column name is a string")
        if not column and field in _REQUIRED:
            raise DataError(
                f"--columns item '{field}=' reads '{field}' from no column, but every row needs 'chosen' and "
                f"'rejected'; map {field} from a column ({field}=COLUMN) or leave it out"
            )
    by_column: dict[str, str] = {}
    for field, column in mapping.items():
        if column and column in by_column:
            raise DataError(
                f"--columns maps column {column!r} to both {by_column[column]!r} and {field!r}; a column feeds one "
                "field: map the other field from its own column"
            )
        by_column[column] = field
    if not mapping:
        raise DataError(f"--columns is empty; give FIELD=COLUMN items, e.g. {_EXAMPLE}, or leave it out")
    return {field: mapping[field] for field in FIELDS if field in mapping}


def rename_columns(row: Any, columns: Mapping[str, str]) -> Any:
    """The row with its mapped columns under their field names; a field that a mapping replaces is not read from the
    row's own column of that name (that column is then ignored, `ignored_columns`), and a field mapped from no
    column (`prompt=`) is not read at all."""
    if not isinstance(row, dict):
        return row
    sources = set(columns.values()) - {""}
    renamed = {k: v for k, v in row.items() if k not in columns and k not in sources}
    for field, column in columns.items():
        if not column:
            continue
        if column in row:
            renamed[field] = row[column]
        elif field in _REQUIRED:
            raise RowReject(
                "missing_field", f"column {column!r} is missing; --columns maps it to '{field}', which every row needs"
            )
    return renamed


def ignored_columns(counts: Mapping[str, int], columns: Mapping[str, str] | None) -> dict[str, int]:
    """Of {column: rows having it}, the columns that no field reads, by name."""
    columns = columns or {}
    sources = set(columns.values()) - {""}
    return {k: counts[k] for k in sorted(counts) if k not in sources and (k not in FIELDS or k in columns)}
