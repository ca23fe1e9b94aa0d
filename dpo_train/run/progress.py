"""Progress on rank 0: the start-up stages (one timed line each), then the training bar (tqdm on a terminal, a
timed line per step in logs)."""

from __future__ import annotations

import sys
import time

from dpo_data.progress import Stage, clock, say

STAGES = {
    "imports": "setup: importing torch",
    "tokenizer": "setup: loading the tokenizer",
    "datasets": "setup: verifying {datasets}",
    "model": "setup: loading the model",
    "probe": "setup: probing the attention path",
    "head": "setup: checking the chunked vocabulary head",
    "reference": "setup: building the reference",
    "resume": "setup: restoring {checkpoint}",
    "first step": "step {step}: first forward and backward",
}
"""What `dpo-train` says before its first step, in the order a run meets them (docs/train-config.md); each is
one line on rank 0, `setup: loading the model ... 3.2 s`. Stages that count (scoring a held-out set) have their
own `Stage` lines."""


def stage(key: str, enabled: bool, **fields: object) -> Stage:
    """The start-up stage `key` of `STAGES`, its fields filled in; silent when not `enabled` (rank > 0, --quiet)."""
    return Stage(STAGES[key].format(**fields), enabled=enabled)


def datasets(count: int) -> str:
    """The `datasets` stage's field: "1 dataset", "2 datasets"."""
    return f"{count} dataset{'s' if count != 1 else ''}"


class Progress:
    """Rank 0's view of training. Until the first step ends, its start-up line (`step N: first forward and
    backward ...`); then on a TTY a tqdm bar, in logs one line per step; nothing when disabled."""

    def __init__(self, total: int, enabled: bool = True, start: int = 0):
        self.total, self.enabled, self.bar = total, enabled, None
        self.start, self.done, self.began = start, start, time.monotonic()
        self.first: Stage | None = None
        self.bar_due = enabled and sys.stderr.isatty()

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        if self.first is not None:
            self.first.__exit__(*exc)
        if self.bar is not None:
            self.bar.close()

    def begin(self) -> None:
        """The first step starts now (after the held-out baseline, which has its own lines)."""
        self.first = stage("first step", self.enabled, step=self.start + 1).__enter__()

    def update(self, record: dict) -> None:
        if self.first is not None:  # the first step is done: its line ends, the bar (if any) starts
            self.first, first = None, self.first
            first.__exit__(None, None, None)
        if self.bar_due:  # after the first step's line, so that the bar never overwrites it
            self.bar_due = False
            from tqdm import tqdm

            self.bar = tqdm(total=self.total, initial=self.start, unit="step", dynamic_ncols=True, file=sys.stderr)
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
            say(f"{line}  eta {clock(eta)}")
