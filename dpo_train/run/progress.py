"""Progress on rank 0: the training bar (tqdm on a terminal, a timed line per step in logs)."""

from __future__ import annotations

import sys
import time

from dpo_data.progress import clock


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
