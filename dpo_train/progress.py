"""Progress on rank 0: the training bar (tqdm on a terminal, a timed line per step in logs) and long stages."""

from __future__ import annotations

import sys
import time

LINE_EVERY_S = 30.0
"""In a log (no terminal), a long stage says how far it is at most this often."""


def clock(seconds: float) -> str:
    """H:MM:SS, as tqdm writes elapsed time and ETA."""
    s = int(seconds)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"


class Progress:
    """Rank 0's view of training. On a TTY a tqdm bar; in logs one line per step; nothing when disabled."""

    def __init__(self, total: int, enabled: bool = True, start: int = 0):
        self.total, self.enabled, self.bar = total, enabled, None
        self.start, self.done, self.began = start, start, time.monotonic()
        if enabled and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=total, initial=start, unit="step", dynamic_ncols=True, file=sys.stderr)

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.close()

    def update(self, record: dict) -> None:
        if not self.enabled:
            return
        fields = (
            f"loss {record['loss']:.4f}",
            f"acc {record['rewards/accuracies']:.3f}",
            f"{record['pairs/s']:.2f} pairs/s",
        )
        if self.bar is not None:
            self.bar.set_postfix_str("  ".join(fields), refresh=False)
            self.bar.update(1)
        else:
            self.done += 1
            elapsed = time.monotonic() - self.began
            eta = elapsed / (self.done - self.start) * (self.total - self.done)
            line = "  ".join((f"step {record['step'] + 1}/{self.total}", *fields, f"elapsed {clock(elapsed)}"))
            print(f"{line}  eta {clock(eta)}", file=sys.stderr, flush=True)


class Stage:
    """One long stage (scoring a dataset, a checkpoint save, the export) on rank 0. With a `total`, a tqdm
    bar on a terminal; in a log, a line when it starts, one at most every `LINE_EVERY_S` with the count,
    elapsed time and ETA, and one when it ends. Nothing when disabled."""

    def __init__(self, name: str, total: int | None = None, enabled: bool = True, unit: str = "batch"):
        self.name, self.total, self.enabled, self.unit = name, total, enabled, unit
        self.count, self.bar, self.began = 0, None, time.monotonic()
        self.said = self.began

    def __enter__(self) -> Stage:
        if self.enabled and self.total is not None and sys.stderr.isatty():
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, desc=self.name, unit=self.unit, dynamic_ncols=True, file=sys.stderr)
        else:
            self._say(f"{self.name} ...")
        return self

    def advance(self, n: int = 1) -> None:
        self.count += n
        if self.bar is not None:
            self.bar.update(n)
            return
        now = time.monotonic()
        if self.total and now - self.said >= LINE_EVERY_S and self.count < self.total:
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
