"""export.json: the last file of an export (final/, final-merged/), listing every other file with bytes and sha256."""

from __future__ import annotations

import os
import re
from pathlib import Path

from dpo_state.commit import listed_files, listing_problems
from dpo_state.errors import DocumentError
from dpo_state.files import read_document, write_json_atomic
from dpo_state.layout import lineage_of, list_checkpoints

EXPORT_FORMAT_VERSION = 1
EXPORT_SCHEMA = "export-manifest"
EXPORT_FILE = "export.json"
EXPORT_NAMES = ("final", "final-merged")
"""The export directories a run writes beside its checkpoints (dpo_train/export/final.py)."""
MODEL_FILES = (
    "config.json",
    "model.safetensors",
    "model.safetensors.index.json",
    "adapter_config.json",
    "adapter_model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
)
"""Files of a model directory, which a run or step directory never holds: with one, a directory is an export."""
CARD_FILE = "README.md"
CARD_ROWS = {"run_id": "run id", "step": "exported at step"}
"""The labels of the model card's lineage rows (dpo_train/export/model_card.py writes them) that state what
export.json's run_id and step must say."""
_CARD_ROWS = {
    "run_id": re.compile(rf"^\| {CARD_ROWS['run_id']} \| (.+) \|$", re.M),
    "step": re.compile(rf"^\| {CARD_ROWS['step']} \| (\d+) \|$", re.M),
}
_CARD_BYTES = 16 << 20  # a card is KBs; read no more of one, whatever its record claims
_EXPORT_AGAIN = "put the files themselves there (cp -r --dereference), or export again"


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


def is_export(directory: str | Path) -> bool:
    """Whether `directory` is an export: it holds its export.json, or (having lost it) model files."""
    directory = Path(directory)
    return any(os.path.lexists(directory / name) for name in (EXPORT_FILE, *MODEL_FILES))


def export_problems(directory: str | Path) -> list[str]:
    """Every way the export `directory` differs from its export.json: its record missing; links; files missing,
    resized, altered, outside it, or present but unlisted; and the record's step and run id against the model
    card (and, in a run directory, the run's checkpoints). Empty when sound."""
    directory = Path(directory)
    if not os.path.lexists(directory / EXPORT_FILE):
        held = ", ".join(name for name in MODEL_FILES if os.path.lexists(directory / name))
        return [
            f"{directory} is an export (it holds {held}) without its {EXPORT_FILE}, the record its files are "
            f"checked against: deleted, or not copied with it. Fix: copy {EXPORT_FILE} along, or export again "
            "(rerun the run: it resumes and re-exports)"
        ]
    problems = link_problems(directory)
    try:
        record = read_export_record(directory)
    except DocumentError as e:
        return problems + [str(e)]
    problems += listing_problems(directory, record["files"], EXPORT_FILE, EXPORT_FILE, "the export")
    if problems:  # the card is evidence only as the record hashed it
        return problems
    return _card_problems(directory, record) + _run_problems(directory, record)


def link_problems(directory: Path, place: str = "the export", fix: str = _EXPORT_AGAIN) -> list[str]:
    """Every symbolic link in `directory` (an export, or a checkpoint: `place`), and `directory` itself where it is
    one: it holds its files themselves, and a link's target (outside it, or anywhere) can change after `verify`
    passed it, be uploaded in its place, or make a copied run verify against another run's bytes."""
    problems = []
    if directory.is_symlink():
        problems.append(
            f"{directory}: a symbolic link (to {os.readlink(directory)}), not {place} itself. Fix: give the "
            f"directory itself ({os.path.realpath(directory)}), or {fix}"
        )
    links = []
    for root, dirs, files in os.walk(directory):  # never into a linked directory
        links += [Path(root, name) for name in dirs + files if os.path.islink(Path(root, name))]
    return problems + [
        f"{link.relative_to(directory).as_posix()}: a symbolic link (to {os.readlink(link)}), not a file of "
        f"{place}. Fix: {fix}"
        for link in sorted(links)
    ]


def _card_problems(directory: Path, record: dict) -> list[str]:
    """export.json's step and run id against what the model card (hashed in the record) says of them. This catches
    a corrupted or hand-edited record, not an editor who rewrites the card and its hash as well (docs/security.md)."""
    if not (directory / CARD_FILE).is_file():
        return [f"{CARD_FILE}: missing, so {EXPORT_FILE}'s step and run_id cannot be checked against the model card"]
    with open(directory / CARD_FILE, "rb") as f:
        card = f.read(_CARD_BYTES).decode(errors="replace")
    problems = []
    for key, row in _CARD_ROWS.items():
        said = row.search(card)
        if said is None:
            problems.append(f"{CARD_FILE}: no lineage row for {key}, so {EXPORT_FILE}'s {key} cannot be checked")
        elif said.group(1) != str(record[key]):
            problems.append(
                f"{EXPORT_FILE}: {key} is {record[key]!r}, but {CARD_FILE} says {said.group(1)!r} (edited or corrupted)"
            )
    return problems


def _run_problems(directory: Path, record: dict) -> list[str]:
    """In its run directory (OUTPUT/final), the export's run id must be a lineage of the run's checkpoints."""
    if directory.name not in EXPORT_NAMES:
        return []
    runs = {lineage_of(path) for _, path in list_checkpoints(directory.parent).committed} - {None}
    if not runs or record["run_id"] in runs:
        return []
    return [
        f"{EXPORT_FILE}: run_id is {record['run_id']!r}, but the checkpoints of {directory.parent} are of run "
        f"{', '.join(sorted(runs))} (edited, or the export of another run)"
    ]
