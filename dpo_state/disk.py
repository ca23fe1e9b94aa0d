"""A full or read-only disk behind any failure: recognized by its errno, named with the fix for the place written."""

from __future__ import annotations

import errno
import os
import re
from pathlib import Path

_FIXES = {
    errno.ENOSPC: "free space on the filesystem holding {place}",
    errno.EDQUOT: "free space within your disk quota on the filesystem holding {place}",
    errno.EROFS: "make the filesystem holding {place} writable again (a disk that went read-only after errors "
    "needs checking first)",
    errno.EFBIG: "raise the file size limit of this shell (ulimit -f)",
}
"""The faults of the disk, not of the data or the code: what a user fixes where the files go."""
_ERRNO_IN_TEXT = re.compile(r"\[errno (\d+)\]|\(os error (\d+)\)", re.IGNORECASE)
"""Where libraries that wrap an OSError keep its code: pyarrow's `[errno 28]`, safetensors' (Rust) `(os error 28)`,
and the text of a failure gathered from another rank."""


def disk_errno(failure: BaseException | str) -> int | None:
    """The errno of a full or read-only disk behind `failure` (an exception, its causes and contexts, the failures
    DCP wraps, or a message's text), or None when the disk is not the cause."""
    for item in _behind(failure):
        code = getattr(item, "errno", None)
        if code in _FIXES:
            return code
        for match in _ERRNO_IN_TEXT.finditer(str(item)):
            if int(match.group(1) or match.group(2)) in _FIXES:
                return int(match.group(1) or match.group(2))
    return None


def disk_fix(code: int, place: str | Path) -> str:
    """What the user does about disk fault `code` (an errno `disk_errno` returns) where `place` is written."""
    return _FIXES[code].format(place=place)


def disk_reason(failure: BaseException | str, code: int) -> str:
    """The fault as one phrase: the system's words for `code`, and the file it hit where `failure` names one."""
    named = next((x.filename for x in _behind(failure) if getattr(x, "filename", None)), None)
    return os.strerror(code) + (f": {named}" if named else "")


def disk_message(failure: BaseException, code: int) -> str:
    """A disk fault that no caller named more closely, as one line: the fault, the file, and the fix for the
    directory holding that file (or for the files the command writes, where the library kept no name)."""
    named = next((x.filename for x in _behind(failure) if getattr(x, "filename", None)), None)
    place = Path(os.fsdecode(named)).parent if named else "the files it writes"
    return f"{disk_reason(failure, code)} ({type(failure).__name__}). Fix: {disk_fix(code, place)}"


def _behind(failure: BaseException | str) -> list[BaseException | str]:
    """`failure` and what it was raised from or while handling, with each rank's failure that DCP's
    CheckpointException wraps (its `failures`: rank -> (exception, traceback)); at most 64 of them."""
    found, todo = [], [failure]
    while todo and len(found) < 64:
        item = todo.pop(0)
        found.append(item)
        if isinstance(item, BaseException):
            wrapped = getattr(item, "failures", None)
            todo += [pair[0] for pair in wrapped.values()] if isinstance(wrapped, dict) else []
            todo += [x for x in (item.__cause__, item.__context__) if x is not None and x not in found]
    return found
