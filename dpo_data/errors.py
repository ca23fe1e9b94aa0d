"""Error types of the data pipeline: each message names the field, the value, what is allowed and the fix."""


class DataError(Exception):
    """A user-facing error of the data pipeline (bad option, unreadable input, failed check)."""


class InputFileError(DataError):
    """An input file that cannot be read as a whole: unreadable, truncated or corrupt."""

    def __init__(self, path: str, reason: str):
        super().__init__(f"input file {path}: {reason}")
        self.path = path
        self.reason = reason
