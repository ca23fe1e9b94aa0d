"""Every relative link in the project's Markdown reaches a file, and its `#anchor` a heading of that file."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FOLDERS = ("docs", "benchmarks", "examples")
PAGES = sorted([ROOT / "README.md", *(page for folder in FOLDERS for page in ROOT.glob(f"{folder}/**/*.md"))])
LINK = re.compile(r"!?\[[^\]]*\]\(([^()\s]+)\)")
FENCE = re.compile(r"^\s*(```|~~~)")
HEADLINE_LIMIT = 400  # docs/benchmarks.md is read in five minutes; the record lives in docs/benchmarks/


def prose(text: str) -> list[str]:
    """The lines outside fenced code blocks, whose `#` lines are not headings and whose brackets are not links."""
    lines, fenced = [], False
    for line in text.splitlines():
        if FENCE.match(line):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def anchors(page: Path) -> Iterator[str]:
    """GitHub's anchors of a page's headings: lower case, punctuation dropped, spaces to hyphens, repeats numbered."""
    seen: dict[str, int] = {}
    for line in prose(page.read_text()):
        match = re.match(r"#{1,6} (.+)", line)
        if match:
            slug = re.sub(r"[^\w\- ]", "", match.group(1).strip().lower()).replace(" ", "-")
            seen[slug] = seen.get(slug, -1) + 1
            yield slug if seen[slug] == 0 else f"{slug}-{seen[slug]}"


def broken(page: Path) -> list[str]:
    problems = []
    for line in prose(page.read_text()):
        for target in LINK.findall(re.sub(r"`[^`]*`", "", line)):
            if re.match(r"[a-z]+:", target):
                continue  # a URL: not this test's to fetch
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            where = f"{page.relative_to(ROOT)}: ({target})"
            if not file.exists():
                problems.append(f"{where} names a file that does not exist")
            elif anchor and file.suffix == ".md" and anchor not in set(anchors(file)):
                problems.append(f"{where}: {file.name} has no heading with that anchor")
    return problems


def test_every_relative_link_reaches_its_file_and_heading():
    assert [problem for page in PAGES for problem in broken(page)] == []


def test_the_benchmarks_page_is_a_headline_page_and_links_every_record_file():
    page = ROOT / "docs" / "benchmarks.md"
    assert len(page.read_text().splitlines()) < HEADLINE_LIMIT
    records = {p.name for p in (ROOT / "docs" / "benchmarks").glob("*.md")}
    linked = {Path(target.partition("#")[0]).name for target in LINK.findall(page.read_text())}
    assert records and records <= linked, f"not linked from docs/benchmarks.md: {sorted(records - linked)}"
