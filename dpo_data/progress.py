"""Long stages' progress: a tqdm bar on a terminal; in a log, timed lines (count, elapsed, ETA)."""

from __future__ import annotations

import sys
import time

LINE_EVERY_S = 30.0
"""In a log (no terminal), a long stage says how far it is at most this often."""


def clock(seconds: float) -> str:
    """H:MM:SS, as tqdm writes elapsed time and ETA."""
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Stage:
    """One long stage (a build, scoring a dataset, a checkpoint save, the export; the trainer shows them on
    rank 0). A tqdm bar on a terminal; in a log, a line when it starts, one at most every `LINE_EVERY_S` with
    the count, elapsed time and ETA (with a `total`), and one when it ends. Nothing when disabled."""

    def __init__(
        self, name: str, total: int | None = None, enabled: bool = True, unit: str = "batch", bar: bool | None = None
    ):
        """`bar`: a tqdm bar on a terminal (default: when there is a `total`; a count without one, as the
        build's rows)."""
        self.name, self.total, self.enabled, self.unit = name, total, enabled, unit
        self.count, self.bar, self.began = 0, None, time.monotonic()
        self.said, self.wants_bar = self.began, total is not None if bar is None else bar

    def __enter__(self) -> Stage:
        if self.enabled and self.wants_bar and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=self.name, unit=self.unit, dynamic_ncols=True, file=sys.stderr)
        else:
            self._say(f"{self.name} ...")
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
        if self.bar is not None:
            self.bar.close()
        if kind is None:
            self._say(f"{self.name}: done in {self._elapsed()}")

    def _elapsed(self) -> str:
        return clock(time.monotonic() - self.began)

    def _say(self, line: str) -> None:
        if self.enabled:
            print(line, file=sys.stderr, flush=True)
            self.said = time.monotonic()
