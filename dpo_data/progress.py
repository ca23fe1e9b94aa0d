"""Long stages' progress: a tqdm bar on a terminal, else one timed line (timed progress lines in a log); `say`."""

from __future__ import annotations

import sys
import time

LINE_EVERY_S = 30.0
"""In a log (no terminal), a long stage says how far it is at most this often."""

_open: Stage | None = None
"""The stage whose line is still open ("name ..." written, its time not yet): anything said first ends it."""


def clock(seconds: float) -> str:
    """H:MM:SS, as tqdm writes elapsed time and ETA."""
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


def duration(seconds: float) -> str:
    """How long something took, one way everywhere: "4.4 s" under a minute, H:MM:SS from one."""
    return f"{seconds:.1f} s" if seconds < 59.95 else clock(round(seconds))


def say(line: str) -> None:
    """Print one line on stderr, after ending an open stage line (so a note never lands inside one)."""
    _end_open_line()
    print(line, file=sys.stderr, flush=True)


def _end_open_line() -> None:
    global _open
    if _open is not None:
        _open = None
        print(file=sys.stderr, flush=True)


class Stage:
    """One long stage (a build, scoring a dataset, a checkpoint save, the export, a start-up step; the trainer
    shows them on rank 0). A tqdm bar on a terminal where it counts. Otherwise one line: `name ...` when it
    starts, its time appended when it ends (`name ... 3.2 s`). In a log, a stage that counts says how far it is
    at most every `LINE_EVERY_S` (count, elapsed, ETA with a `total`); once anything else was said after its
    first line, it ends with `name: done in 3.2 s`. Nothing when disabled."""

    def __init__(
        self, name: str, total: int | None = None, enabled: bool = True, unit: str = "batch", bar: bool | None = None
    ):
        """`bar`: a tqdm bar on a terminal (default: when there is a `total`; a count without one, as the
        build's rows)."""
        self.name, self.total, self.enabled, self.unit = name, total, enabled, unit
        self.count, self.bar, self.began = 0, None, time.monotonic()
        self.said, self.wants_bar = self.began, total is not None if bar is None else bar
        self.seconds: float | None = None
        """How long the stage took, set when it ends: the time it printed."""

    def __enter__(self) -> Stage:
        if self.enabled and self.wants_bar and sys.stderr.isatty():
            from tqdm import tqdm

            _end_open_line()
            self.bar = tqdm(total=self.total, desc=self.name, unit=self.unit, dynamic_ncols=True, file=sys.stderr)
        elif self.enabled:
            _start_line(self)
        self.began = self.said = time.monotonic()
        return self

    def update(self, n: int = 1) -> None:
        """tqdm's name for `advance`, for code that takes either."""
        self.advance(n)

    def advance(self, n: int = 1) -> None:
        self.count += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if now - self.said < LINE_EVERY_S or (self.total is not None and self.count >= self.total):
            return
        if self.total is None:
            self._say(f"{self.name}: {self.count} {self.unit}  elapsed {self._elapsed()}")
            return
        eta = clock((now - self.began) / self.count * (self.total - self.count))
        self._say(f"{self.name}: {self.count}/{self.total} {self.unit}  elapsed {self._elapsed()}  eta {eta}")

    def __exit__(self, kind, *exc) -> None:
        global _open
        self.seconds = time.monotonic() - self.began
        if self.bar is not None:
            self.bar.close()
        if not self.enabled:
            return
        if _open is self:  # the line is still ours: its time ends it, or a failure leaves it unfinished
            _open = None
            print(f" {duration(self.seconds)}" if kind is None else "", file=sys.stderr, flush=True)
        elif kind is None:
            self._say(f"{self.name}: done in {duration(self.seconds)}")

    def _elapsed(self) -> str:
        return clock(time.monotonic() - self.began)

    def _say(self, line: str) -> None:
        if self.enabled:
            say(line)
            self.said = time.monotonic()


def _start_line(stage: Stage) -> None:
    """Write `name ...` and leave the line open for the stage's time."""
    global _open
    _end_open_line()
    print(f"{stage.name} ...", end="", file=sys.stderr, flush=True)
    _open = stage
