"""The progress line on a terminal (tqdm: step, loss, accuracy, pairs/s, ETA); a plain line per step otherwise."""

from __future__ import annotations

import sys


class Progress:
    """Rank 0's view of training. On a TTY a tqdm bar; in logs one line per step; nothing when disabled."""

    def __init__(self, total: int, enabled: bool = True, start: int = 0):
        self.total, self.enabled, self.bar = total, enabled, None
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
            print(f"step {record['step'] + 1}/{self.total}  " + "  ".join(fields), file=sys.stderr, flush=True)
