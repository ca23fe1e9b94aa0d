"""Early stopping on a held-out metric: the run ends after `patience` evaluations without a gain."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

LOWER_IS_BETTER = {
    "loss": True,
    "nll": True,
    "accuracy": False,
    "rewards/margins": False,
    "logratio_margin": False,
    "logp_accuracy": False,
}
"""The eval.jsonl metrics early stopping may watch, and which way each improves."""
RENAMED = {
    "margin": "eval.jsonl's `margin` (the raw log-ratio margin) is logratio_margin since eval format 4; set "
    "logratio_margin to watch it as before (same threshold), or rewards/margins, TRL's beta-scaled reward margin "
    "(scale early_stopping_threshold by loss.beta)"
}
"""Metric names a config may still hold from an earlier release: refused with what each became."""


@dataclass
class EarlyStopping:
    """The watch over one metric (`eval.early_stopping_metric`), checkpointed with the train state so that
    a resumed run counts on where it stood: the best value and its step, and evaluations since a gain."""

    metric: str
    patience: int
    threshold: float
    best: float | None = None
    best_step: int | None = None
    evals_without_gain: int = 0
    stopped: bool = False

    def update(self, record: dict) -> bool:
        """Count one evaluation; True once `patience` evaluations in a row have not beaten the best by more
        than `threshold` (HF's EarlyStoppingCallback rule; a value that is not finite never gains). The
        evaluation before training sets the first best."""
        value = record.get(self.metric)
        finite = value is not None and math.isfinite(value)
        if finite and (self.best is None or self._gain(value) > self.threshold):
            self.best, self.best_step, self.evals_without_gain = float(value), int(record["step"]), 0
        else:
            self.evals_without_gain += 1
        self.stopped = self.evals_without_gain >= self.patience
        return self.stopped

    def _gain(self, value: float) -> float:
        return self.best - value if LOWER_IS_BETTER[self.metric] else value - self.best

    def reason(self) -> str:
        """The line that says why the run stopped."""
        return (
            f"early stopping: eval {self.metric} has not improved on {self.best:.6g} (step {self.best_step}) by more "
            f"than {self.threshold:g} in {self.evals_without_gain} evaluations (eval.early_stopping_patience "
            f"{self.patience}); the run ends here"
        )

    def state_dict(self) -> dict[str, Any]:
        keys = ("metric", "best", "best_step", "evals_without_gain", "stopped")
        return {key: getattr(self, key) for key in keys}

    def load_state_dict(self, state: dict[str, Any] | None) -> None:
        """A checkpoint's watch; none (an older checkpoint, or early stopping newly set) or one over another
        metric starts afresh."""
        if state is None or state["metric"] != self.metric:
            return
        self.best, self.best_step = state["best"], state["best_step"]
        self.evals_without_gain, self.stopped = int(state["evals_without_gain"]), bool(state["stopped"])


def early_stopping_watch(eval_config: Any) -> EarlyStopping | None:
    """The run's watch, or None without `eval.early_stopping_metric`."""
    if eval_config.early_stopping_metric is None:
        return None
    return EarlyStopping(
        eval_config.early_stopping_metric, eval_config.early_stopping_patience, eval_config.early_stopping_threshold
    )
