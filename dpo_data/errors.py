"""Error types of the data pipeline, in the project's one family (`dpo_state.errors.ToolkitError`)."""

from __future__ import annotations

from dpo_state.errors import ToolkitError


class DataError(ToolkitError):
    """A user-facing error of the data pipeline (bad option, unreadable input, damaged dataset, a pair
    over the token budget); the message names the field, the value, what is allowed and the fix."""


class InputFileError(DataError):
    """An input file that cannot be read as a whole: unreadable, truncated or corrupt."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"input file {path}: {reason}")
        self.path = path
        self.reason = reason


class OutputWriteError(DataError):
    """An output a build or merge cannot write (a full or read-only disk, no space in the quota): the machine's,
    not the input's, so the exit code is 1; the message names the place, what is left and the fix."""

    exit_code = 1
