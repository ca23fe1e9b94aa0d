"""Where checkpoints live: OUTPUT/checkpoints/step-NNNNNN/; committed vs incomplete; latest; retention."""

from __future__ import annotations

import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

from dpo_state.commit import COMMIT_FILE
from dpo_state.errors import DocumentError, StateError

CHECKPOINTS = "checkpoints"
ABANDONED = "abandoned"
"""Under checkpoints/: committed checkpoints moved aside (another branch, or damaged), never deleted."""
_STEP_DIR = re.compile(r"^step-(\d{6,})$")


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / CHECKPOINTS / f"step-{step:06d}"


@dataclass(frozen=True)
class Listing:
    """A run's checkpoints by step: committed ones (commit record present) and incomplete ones."""

    committed: list[tuple[int, Path]]
    incomplete: list[tuple[int, Path]]

    @property
    def latest(self) -> Path | None:
        return self.committed[-1][1] if self.committed else None


def list_checkpoints(run_dir: str | Path) -> Listing:
    root = Path(run_dir) / CHECKPOINTS
    committed, incomplete = [], []
    for path in sorted(root.iterdir()) if root.is_dir() else []:
        match = _STEP_DIR.match(path.name)
        if match and path.is_dir():
            (committed if (path / COMMIT_FILE).is_file() else incomplete).append((int(match.group(1)), path))
    return Listing(sorted(committed), sorted(incomplete))


def resolve(path: str | Path) -> Path:
    """A step directory as given, or for a run's output directory its latest committed step."""
    path = Path(path)
    if (path / COMMIT_FILE).is_file() or _STEP_DIR.match(path.name):
        return path
    listing = list_checkpoints(path)
    if listing.latest is None:
        raise StateError(
            f"{path} holds no committed checkpoint (looked in {path / CHECKPOINTS}); "
            "give a step directory or a run's output directory"
        )
    return listing.latest


def lineage_of(path: Path) -> str | None:
    """The run id of a checkpoint's lineage (None when its state cannot be read)."""
    from dpo_state.state import read_state

    try:
        return read_state(path)["lineage"]["run_id"]
    except DocumentError:
        return None


def retain(run_dir: str | Path, keep_last: int, run_id: str, writing: Path | None = None) -> list[Path]:
    """Delete committed checkpoints of lineage `run_id` beyond its newest `keep_last`, and incomplete
    ones older than the newest committed. Never the newest committed one, never `writing`, never a
    checkpoint of another lineage (or one whose lineage cannot be read). Returns what was deleted."""
    listing = list_checkpoints(run_dir)
    mine = [(s, p) for s, p in listing.committed if lineage_of(p) == run_id]
    keep = {p for _, p in mine[-max(1, keep_last) :]}
    newest = listing.committed[-1][0] if listing.committed else -1
    doomed = [p for _, p in mine if p not in keep]
    doomed += [p for s, p in listing.incomplete if s < newest]
    doomed = [p for p in doomed if writing is None or p.resolve() != Path(writing).resolve()]
    for path in doomed:
        # remove the commit record first: a half-deleted checkpoint must read as incomplete, never as committed
        (path / COMMIT_FILE).unlink(missing_ok=True)
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def move_aside(run_dir: str | Path, paths: list[Path], why: str) -> Path | None:
    """Move committed checkpoints out of the way into a new checkpoints/abandoned/<time>-<why>[-N]/, keeping them."""
    if not paths:
        return None
    target = _fresh(Path(run_dir) / CHECKPOINTS / ABANDONED, f"{time.strftime('%Y%m%dT%H%M%S')}-{why}")
    for path in paths:
        os.rename(path, target / path.name)
    return target


def _fresh(parent: Path, name: str) -> Path:
    """A new directory `parent/name`, or `name-2`, `name-3`, ... when taken: two moves within one second (two
    resumes from one step) must not put a step's directory where the first move already put one of that name."""
    parent.mkdir(parents=True, exist_ok=True)
    n = 1
    while True:
        target = parent / (name if n == 1 else f"{name}-{n}")
        try:
            target.mkdir()
            return target
        except FileExistsError:
            n += 1
