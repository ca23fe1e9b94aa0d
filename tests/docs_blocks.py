"""Generated parts of docs/: Markdown tables, and the text between `<!-- NAME:start -->` and `<!-- NAME:end -->`."""

from __future__ import annotations

import difflib
import re
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def markers(name: str) -> tuple[str, str]:
    return f"<!-- {name}:start -->", f"<!-- {name}:end -->"


def read_block(doc: Path, name: str) -> str:
    """The generated block `name` of `doc`, without its markers and surrounding blank lines."""
    start, end = markers(name)
    text = doc.read_text()
    return text[text.index(start) + len(start) : text.index(end)].strip()


def write_block(doc: Path, name: str, block: str) -> None:
    """Replace the generated block `name` of `doc` with `block` (the markers stay)."""
    start, end = markers(name)
    text = doc.read_text()
    doc.write_text(text[: text.index(start) + len(start)] + "\n" + block + "\n" + text[text.index(end) :])


def markdown_table(head: list[str], rows: list[list[str]]) -> str:
    """A Markdown table: the header, its rule, a line per row."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


NUMBER = re.compile(r"\d\.\de[-+]\d\d")
"""A measured number as the generated tables write it (`f"{x:.1e}"`)."""


def differences(docs: str, measured: str, factor: float) -> list[str]:
    """Where a generated block in the docs differs from the block just rendered: any text (a unified diff), or
    a measured number off by more than `factor` either way (rounding differs from machine to machine)."""
    if NUMBER.split(docs) != NUMBER.split(measured):
        return list(difflib.unified_diff(docs.splitlines(), measured.splitlines(), "docs", "measured", lineterm=""))
    problems = []
    for written, seen in zip(NUMBER.findall(docs), NUMBER.findall(measured)):
        low, high = sorted((float(written), float(seen)))
        if high > low * factor:
            problems.append(f"the docs say {written}, this run measured {seen}")
    return problems
