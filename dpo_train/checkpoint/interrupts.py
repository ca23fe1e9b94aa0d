"""Ctrl-C during a checkpoint save is held until the save ends: the run stops after it, never half-way through."""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator


@contextlib.contextmanager
def held_until_saved(step: int, announce: bool) -> Iterator[None]:
    """A SIGINT inside the block is held and raised as KeyboardInterrupt when the block ends; a second one raises
    at once (the user insists: the crash-safe commit keeps the previous checkpoint the latest).

    Why: DCP's `save` catches every exception, KeyboardInterrupt included, and wraps it as a failed save, and a zip
    writer interrupted half-way raises a RuntimeError of its own; a Ctrl-C there was reported as "saving step N
    failed" (exit 1, the disk named as the cause) and lost the checkpoint it interrupted. Held, the save commits,
    and the run exits 130 naming it. `announce`: say on stderr that the interrupt was heard (rank 0)."""
    if threading.current_thread() is not threading.main_thread() or (
        signal.getsignal(signal.SIGINT) is not signal.default_int_handler  # someone else's: leave it theirs
    ):
        yield
        return
    heard: list[int] = []

    def hold(signum, frame) -> None:
        if heard:
            raise KeyboardInterrupt
        heard.append(signum)
        if announce:
            print(f"interrupt: finishing the save of step {step} first (Ctrl-C again stops now)", file=sys.stderr)

    signal.signal(signal.SIGINT, hold)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    if heard:
        raise KeyboardInterrupt
