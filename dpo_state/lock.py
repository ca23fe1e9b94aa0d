"""One exclusive holder per directory: a `DIR.lock` file beside it, flock'ed, naming who holds it."""

from __future__ import annotations

import errno
import fcntl
import os
import socket
import time
from pathlib import Path

from dpo_state.errors import ToolkitError


class DirectoryBusy(ToolkitError):
    """Another process holds the directory's lock; the message names the holder."""


class DirectoryLock:
    """An exclusive lock on `DIR.lock`, beside `directory`: a second holder fails fast, naming the first.

    The lock file stays after release (deleting it would race with a process that just opened it); it
    holds the holder's pid, host and start time. `busy` and `unwritable` word the errors for the caller
    (`{holder}`, `{lock}` and `{reason}` are filled in), `error` and `unwritable_error` type them.
    """

    def __init__(
        self,
        directory: str | Path,
        busy: str,
        unwritable: str,
        error: type[ToolkitError] = DirectoryBusy,
        unwritable_error: type[ToolkitError] | None = None,
    ):
        directory = Path(directory)
        self.path = directory.with_name(directory.name + ".lock")
        self._busy, self._unwritable = busy, unwritable
        self._error, self._unwritable_error = error, unwritable_error or error
        self._fd: int | None = None

    def __enter__(self) -> DirectoryLock:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise self._unwritable_error(self._unwritable.format(lock=self.path, reason=e.strerror)) from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            holder = _holder(fd)
            os.close(fd)
            if e.errno in (errno.EAGAIN, errno.EACCES):
                raise self._error(self._busy.format(holder=holder, lock=self.path)) from None
            raise
        # written over the previous holder's line, then cut to length: the file is never empty while held
        line = f"pid {os.getpid()} on {socket.gethostname()}, since {time.ctime()}\n".encode()
        try:
            os.pwrite(fd, line, 0)
            os.ftruncate(fd, len(line))
        except OSError as e:  # a full disk takes the empty file but not its line
            os.close(fd)
            raise self._unwritable_error(self._unwritable.format(lock=self.path, reason=e.strerror)) from None
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
