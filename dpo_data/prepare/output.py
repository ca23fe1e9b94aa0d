"""Where a build writes: one lock per output path, a private staging directory, an atomic swap into place."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import signal
import socket
import sys
import time
import uuid
from pathlib import Path

from dpo_data.dataset.manifest import MANIFEST_NAME, REJECTS_NAME, read_manifest
from dpo_data.dataset.shards import SHARD_DIR
from dpo_data.errors import DataError
from dpo_state.files import fsync_dir

KILL_ENV = "DPO_DATA_KILL"
"""Testing hook for crash tests: `before-swap`, `after-swap` or `after-delete` SIGKILLs the build there."""
_BUILD_ENTRIES = {MANIFEST_NAME, REJECTS_NAME, SHARD_DIR, f".{MANIFEST_NAME}.tmp"}
"""Everything a build ever writes at the top of its directory: `--overwrite` replaces nothing else."""


class OutputLock:
    """An exclusive lock on `OUT.lock`, beside the output directory: one build per output path at a time.

    The lock file stays after the build (deleting it would race with a build that just opened it); it
    holds the holder's pid, host and start time, so a refused build can name who holds it.
    """

    def __init__(self, out: Path):
        self.path = out.with_name(out.name + ".lock")
        self._fd: int | None = None

    def __enter__(self) -> OutputLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise DataError(
                f"--out {self.path.with_suffix('')}: cannot create the lock file {self.path} "
                f"({e.strerror}); choose a writable location"
            ) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _holder(fd)
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise DataError(
                    f"--out {self.path.with_suffix('')} is being built by another process ({holder}); "
                    "wait for it to finish, or choose another --out"
                ) from None
            raise
        # written over the previous holder's line, then cut to length: the file is never empty while held
        holder = f"pid {os.getpid()} on {socket.gethostname()}, since {time.ctime()}\n".encode()
        os.pwrite(fd, holder, 0)
        os.ftruncate(fd, len(holder))
        self._fd = fd
        return self

    def __exit__(self, *exc) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing releases the flock
            self._fd = None


def _holder(fd: int) -> str:
    """Who holds the lock, as its holder wrote it. A holder that has just taken a new lock file has not
    written its line yet: wait for it (up to a second) rather than name nobody."""
    for _ in range(50):
        line = os.pread(fd, 512, 0).decode("utf-8", "replace").strip()
        if line:
            return line
        time.sleep(0.02)
    return "holder unknown"


def new_staging(out: Path) -> Path:
    """A staging directory of this build alone, beside `out` (same filesystem, so the swap is a rename)."""
    staging = out.with_name(f"{out.name}.incomplete-{uuid.uuid4().hex[:12]}")
    try:
        staging.mkdir(parents=True)
    except OSError as e:
        raise DataError(f"--out {out}: cannot create {staging} ({e.strerror}); choose a writable location") from None
    return staging


def check_replaceable(out: Path, overwrite: bool) -> None:
    """`out` may be written: it does not exist, or with --overwrite it is a committed dataset (or a
    leftover holding only what a build writes). Anything else is refused by name, never deleted."""
    if not out.exists() and not out.is_symlink():
        return
    if not overwrite:
        raise DataError(f"--out {out} already exists; pass --overwrite to replace it, or choose another directory")
    if not out.is_dir() or out.is_symlink():
        raise DataError(f"--out {out} is not a directory; --overwrite replaces only a dataset directory")
    try:
        read_manifest(out, consistent=False)
        return
    except DataError:
        pass
    foreign = sorted(p.name for p in out.iterdir() if p.name not in _BUILD_ENTRIES)
    if foreign or not any(out.iterdir()):
        listing = ", ".join(foreign[:5]) + ("..." if len(foreign) > 5 else "") if foreign else "nothing a build writes"
        raise DataError(
            f"--out {out} is not a dataset (no valid {MANIFEST_NAME}; it holds {listing}); --overwrite "
            "replaces only a dataset or an incomplete build of one: choose another --out"
        )


def check_inputs_outside(out: Path, inputs: list[str]) -> None:
    """An input inside the output directory would be deleted by the build that reads it."""
    root = out.resolve()
    for given in inputs:
        path = Path(given).resolve()
        if path == root or root in path.parents:
            raise DataError(
                f"input {given} lies inside --out {out}, which the build replaces; move it or choose another --out"
            )


def swap_into_place(staging: Path, out: Path) -> None:
    """Make the finished `staging` the dataset at `out` atomically: at every instant `out` is the old
    dataset or the new one. Linux swaps the two directories in one renameat2(RENAME_EXCHANGE); the old
    one, now at `staging`, is deleted after. Where that is unavailable, a plain rename (no old `out`)."""
    _kill_point("before-swap")
    if out.exists():
        _exchange(staging, out)
        fsync_dir(out.parent)
        _kill_point("after-swap")
        shutil.rmtree(staging)
    else:
        os.rename(staging, out)
        fsync_dir(out.parent)
        _kill_point("after-swap")
    _kill_point("after-delete")


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
        raise DataError(
            f"--overwrite {b}: the atomic swap with {a} failed ({os.strerror(code)}); {b} is unchanged "
            f"and the new build is in {a}"
        )


def _kill_point(name: str) -> None:
    if os.environ.get(KILL_ENV) == name:
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
