"""The project's one error family: every error a user can cause or fix derives from `ToolkitError`."""

from __future__ import annotations


class ToolkitError(Exception):
    """An error the user can fix: a bad option, config, input, dataset, checkpoint or attestation.

    The message names what is wrong, the value, what is allowed and the fix. Every CLI catches this
    base, prints the message and exits with `exit_code`, so a user error is never a traceback.
    """

    exit_code = 2


class DocumentError(ToolkitError):
    """A persisted JSON document (manifest, state, commit record, sidecar, rank file) that is missing,
    oversized, a pickle, malformed, off its schema or of another format version; the message names the file."""


class SchemaError(DocumentError):
    """A document that does not match its JSON Schema; the message lists every violation with its path."""

    def __init__(self, what: str, problems: list[str]):
        super().__init__(f"{what} does not match its schema:\n  - " + "\n  - ".join(problems))
        self.problems = problems


class StateError(ToolkitError):
    """A checkpoint that cannot be used: none committed where one was expected, or its files fail their record."""


class AttestationError(ToolkitError):
    """A tokenizer that cannot be attested (for example a slow tokenizer without a Rust backend)."""


class DependencyError(ToolkitError):
    """An installed library outside the range dpo-toolkit declares (missing, too old, too new); the message
    names each, the version found, the range and the pip command that fixes it."""
