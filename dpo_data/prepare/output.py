"""Where a build writes: one lock per output path, a private staging directory, an atomic swap into place."""

from __future__ import annotations

import ctypes
import os
import re
import shutil
import stat
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from dpo_data.dataset.manifest import MANIFEST_NAME, PART_NAME, REJECTS_NAME, STAGING_SUFFIX, read_manifest
from dpo_data.dataset.shards import SHARD_DIR
from dpo_data.errors import DataError, OutputWriteError
from dpo_state.disk import disk_errno, disk_fix, disk_reason
from dpo_state.faults import data_kill_point
from dpo_state.files import fsync_dir
from dpo_state.lock import DirectoryLock

if TYPE_CHECKING:
    from dpo_data.prepare.tally import BuildResult

_BUILD_ENTRIES = {
    MANIFEST_NAME,
    REJECTS_NAME,
    SHARD_DIR,
    PART_NAME,
    *(f".{name}.tmp" for name in (MANIFEST_NAME, PART_NAME)),
}
"""Everything a build (whole or `--part`) ever writes at the top of its directory: `--overwrite` replaces
nothing else."""
_SHARD_FILE = re.compile(r"shard-\d{5,}\.arrow")
"""The files a build writes in `shards/` (`ShardWriter`'s names)."""


class OutputLock(DirectoryLock):
    """One build per output path at a time: `OUT.lock`, beside the output directory, names its holder."""

    def __init__(self, out: Path):
        super().__init__(
            out,
            busy=f"--out {out} is being built by another process ({{holder}}); wait for it to finish, or "
            "choose another --out",
            unwritable=f"--out {out}: cannot create the lock file {{lock}} ({{reason}}); choose a writable location",
            error=DataError,
        )


def new_staging(out: Path) -> Path:
    """A staging directory of this build alone, beside `out` (same filesystem, so the swap is a rename)."""
    staging = out.with_name(f"{out.name}.incomplete-{uuid.uuid4().hex[:12]}")
    try:
        staging.mkdir(parents=True)
    except OSError as e:
        raise DataError(f"--out {out}: cannot create {staging} ({e.strerror}); choose a writable location") from None
    return staging


def commit_staged(out: Path, overwrite: bool, produce: Callable[[Path], BuildResult]) -> BuildResult:
    """The one way a build or a merge writes `out` (holding `OutputLock(out)`): check that `out` may be replaced,
    `produce` into a new staging directory (deleted if it raises), and when the result is committed swap it into
    place and remove earlier builds' leftovers; a refused result's staging stays, for its rejects."""
    check_replaceable(out, overwrite)
    staging = new_staging(out)
    try:
        result = produce(staging)
    except BaseException as e:
        shutil.rmtree(staging, ignore_errors=True)  # a failed build leaves nothing behind
        _raise_disk_fault(out, staging, e, "could not be written")
        raise
    if result.committed:
        try:
            swap_into_place(staging, out, overwrite)
        except OSError as e:  # a rename the disk refused: nothing moved, the finished build stays in staging
            _raise_disk_fault(out, staging, e, "could not be moved into place")
            raise
        result.out = out
        remove_stale_staging(out)  # earlier refused or killed builds' leftovers, kept until now for their rejects
    return result


def _raise_disk_fault(out: Path, staging: Path, e: BaseException, failed: str) -> None:
    """Raise an `OutputWriteError` where the disk stopped the build (full, read-only, over quota), naming the fault,
    what `out` holds, what `staging` still holds and the fix; anything else is for the caller to raise."""
    code = disk_errno(e) if isinstance(e, Exception) else None
    if code is None:
        return
    kept = f"; {out} is unchanged" if out.exists() else ""
    left = f"; {staging} is left (the next build of --out that commits removes it)" if staging.exists() else ""
    raise OutputWriteError(
        f"--out {out}: the build {failed} ({disk_reason(e, code)}); nothing was committed{kept}{left}. "
        f"Fix: {disk_fix(code, out.parent)}, or choose another --out"
    ) from None


def check_replaceable(out: Path, overwrite: bool) -> None:
    """`out` may be written: it does not exist, or with --overwrite it is a committed dataset (or a
    leftover) holding only what a build writes. Anything else is refused by name, never deleted."""
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise DataError(f"--out {out} already exists; pass --overwrite to replace it, or choose another directory")
    if not out.is_dir() or out.is_symlink():
        raise DataError(f"--out {out} is not a directory; --overwrite replaces only a dataset directory")
    foreign = _build_output(out)[1]
    try:
        read_manifest(out, consistent=False)
    except DataError:
        if foreign or not any(out.iterdir()):
            listing = _listing(foreign) if foreign else "nothing a build writes"
            raise DataError(
                f"--out {out} is not a dataset (no valid {MANIFEST_NAME}; it holds {listing}); --overwrite "
                "replaces only a dataset or an incomplete build of one: choose another --out"
            ) from None
        return
    if foreign:
        raise DataError(
            f"--out {out} is a dataset that also holds {_listing(foreign)}, which no build wrote; --overwrite "
            f"would delete them with the old dataset: move them out of {out}, or choose another --out"
        )


def _listing(names: list[str]) -> str:
    return ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")


def _build_output(directory: Path) -> tuple[list[Path], list[str]]:
    """Split what `directory` holds into what a build writes (each directory after its files) and the
    rest, by relative name. A build writes only regular files and `shards/`: a link is never its own."""
    ours: list[Path] = []
    foreign: list[str] = []
    for entry in sorted(directory.iterdir()):
        mode = entry.lstat().st_mode
        if entry.name == SHARD_DIR and stat.S_ISDIR(mode):
            for shard in sorted(entry.iterdir()):
                if _SHARD_FILE.fullmatch(shard.name) and stat.S_ISREG(shard.lstat().st_mode):
                    ours.append(shard)
                else:
                    foreign.append(f"{SHARD_DIR}/{shard.name}")
            ours.append(entry)
        elif entry.name in _BUILD_ENTRIES and entry.name != SHARD_DIR and stat.S_ISREG(mode):
            ours.append(entry)
        else:
            foreign.append(entry.name)
    return ours, foreign


def remove_build_output(directory: Path) -> None:
    """Delete what a build wrote in `directory`, then the directory if that emptied it; anything else
    stays where it is. Best effort: what cannot be read or deleted stays too (the build is committed)."""
    try:
        ours = _build_output(directory)[0]
    except OSError:
        return
    for path in [*ours, directory]:
        try:
            if path.is_dir():
                path.rmdir()  # fails while it holds something foreign: then it stays
            else:
                path.unlink()
        except OSError:
            pass


def remove_stale_staging(out: Path) -> None:
    """Remove the staging directories earlier builds of `out` left (refused, or killed). Call only
    holding `out`'s lock, so no running build owns one; what a build did not write is kept."""
    pattern = re.compile(re.escape(out.name) + STAGING_SUFFIX)
    for staging in out.parent.iterdir():
        if pattern.fullmatch(staging.name) and staging.is_dir() and not staging.is_symlink():
            remove_build_output(staging)


def check_inputs_outside(out: Path, inputs: list[str]) -> None:
    """An input inside the output directory would be deleted by the build that reads it."""
    root = out.resolve()
    for given in inputs:
        path = Path(given).resolve()
        if path == root or root in path.parents:
            raise DataError(
                f"input {given} lies inside --out {out}, which the build replaces; move it or choose another --out"
            )


def swap_into_place(staging: Path, out: Path, overwrite: bool) -> None:
    """Make the finished `staging` the dataset at `out` atomically: at every instant `out` is the old
    dataset or the new one. Linux swaps the two directories in one renameat2(RENAME_EXCHANGE); what a
    build wrote of the old one, now at `staging`, is deleted after. Where that is unavailable, a plain
    rename (no old `out`)."""
    try:
        check_replaceable(out, overwrite)  # again: a long build gives others time to write into `out`
    except DataError as e:
        raise DataError(f"{e} (nothing was committed; the new build is in {staging})") from None
    data_kill_point("before-swap")
    if out.exists():
        _exchange(staging, out)
        fsync_dir(out.parent)
        data_kill_point("after-swap")
        remove_build_output(staging)
    else:
        os.rename(staging, out)
        fsync_dir(out.parent)
        data_kill_point("after-swap")
    data_kill_point("after-delete")


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        raise DataError(
            f"--overwrite {b}: this system has no atomic directory exchange (renameat2); remove "
            f"{b} yourself, or build into a new --out"
        )
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) != 0:
        code = ctypes.get_errno()
        if disk_errno(OSError(code, "")) is not None:  # a full or read-only disk: `commit_staged` names it so
            raise OSError(code, os.strerror(code), str(b))
        raise DataError(
            f"--overwrite {b}: the atomic swap with {a} failed ({os.strerror(code)}); {b} is unchanged "
            f"and the new build is in {a}"
        )
