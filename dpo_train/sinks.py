"""Optional metric sinks (`train.report_to`): the step scalars of metrics.jsonl also written as TensorBoard events."""

from __future__ import annotations

from pathlib import Path

from dpo_state.run_logs import step_scalars
from dpo_train.errors import ConfigError

REPORT_TO = ("tensorboard",)
TENSORBOARD_DIR = "tensorboard"


def check_report_to(report_to: list[str]) -> None:
    """Unknown sinks and a missing optional package fail before anything starts."""
    if "tensorboard" in report_to:
        try:
            import tensorboard  # noqa: F401 - torch's SummaryWriter needs it
        except ImportError:
            raise ConfigError(
                "train.report_to lists tensorboard, but the tensorboard package is not installed; install it "
                "with `pip install 'dpo-toolkit[report]'`, or drop it from train.report_to"
            ) from None


class MetricSinks:
    """Rank 0's sinks. TensorBoard events go to OUTPUT/tensorboard/, on an axis of optimizer steps done
    (metrics.jsonl step + 1), the axis of eval.jsonl and of checkpoint directories. A run resumed after k
    steps marks a restart at k + 1, so TensorBoard hides the earlier session's events from there on (those
    steps are trained again, as `_truncate_logs` drops their lines); a fresh start hides all earlier ones."""

    def __init__(self, report_to: list[str], out: Path, rank: int, resumed_at: int | None):
        self.writer = None
        if rank == 0 and "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            purge = 0 if resumed_at is None else resumed_at + 1
            self.writer = SummaryWriter(log_dir=str(out / TENSORBOARD_DIR), purge_step=purge)

    def step(self, record: dict) -> None:
        """One metrics.jsonl record: every scalar under its metrics name (`sources/NAME/KEY` per source)."""
        self._write(step_scalars(record), record["step"] + 1, record.get("time"))

    def evaluation(self, record: dict) -> None:
        """One eval.jsonl record, under `eval/KEY`."""
        scalars = {f"eval/{k}": v for k, v in record.items() if k not in ("format_version", "step")}
        self._write(scalars, record["step"], None)

    def _write(self, scalars: dict, step: int, walltime: float | None) -> None:
        if self.writer is None:
            return
        for name, value in scalars.items():
            if value is not None:  # not finite: metrics.jsonl says null, TensorBoard gets no point
                self.writer.add_scalar(name, value, step, walltime=walltime)
        self.writer.flush()  # a running run is visible step by step

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        if self.writer is not None:
            self.writer.close()
