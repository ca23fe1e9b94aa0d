"""How every command reports a user error: one line naming it, and the error's exit code (never a traceback)."""

from __future__ import annotations

import contextlib
import sys

import click

from dpo_state.errors import ToolkitError


def fail(message: str, code: int = 2) -> None:
    """Print `error: message` to stderr and exit with `code`."""
    click.echo(f"error: {message}", err=True)
    sys.exit(code)


@contextlib.contextmanager
def user_errors(*also: type[BaseException]):
    """Turn any `ToolkitError` (and the exception types in `also`) raised inside into `fail`."""
    try:
        yield
    except (ToolkitError, *also) as e:
        fail(str(e), getattr(e, "exit_code", 2))
