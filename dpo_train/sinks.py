"""Optional metric sinks (`train.report_to`): the step scalars of metrics.jsonl also written as TensorBoard events."""

from __future__ import annotations

import contextlib
import os
import threading
from pathlib import Path

from dpo_state.run_logs import step_scalars
from dpo_train.errors import ConfigError, WriteError

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


def check_sinks(report_to: list[str], out: Path) -> None:
    """Rank 0, before anything trains: OUTPUT/tensorboard is a directory (or can be made one) that takes
    a file. A file in its place is the user's to move (exit 2); a disk that refuses the write, exit 1."""
    if "tensorboard" not in report_to:
        return
    directory = out / TENSORBOARD_DIR
    if directory.exists() and not directory.is_dir():
        raise ConfigError(
            f"train.report_to: tensorboard writes its event files into {directory}, which is a file; move the "
            "file away, or set another train.output_dir"
        )
    probe = directory / f".write-probe-{os.getpid()}"
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with open(probe, "wb") as f:  # a page, synced: a disk that is full now says so here
            f.write(bytes(4096))
            f.flush()
            os.fsync(f.fileno())
        probe.unlink()
    except OSError as e:
        with contextlib.suppress(OSError):  # a read-only disk refuses even this
            probe.unlink(missing_ok=True)
        raise WriteError(_cannot_write(directory, e)) from None


def _cannot_write(directory: Path, e: OSError) -> str:
    return (
        f"train.report_to: tensorboard cannot write its event files into {directory} ({e.strerror or e}); free "
        "space or make the directory writable, or drop tensorboard from train.report_to (metrics.jsonl holds "
        "the same scalars)"
    )


class MetricSinks:
    """Rank 0's sinks. TensorBoard events go to OUTPUT/tensorboard/, on an axis of optimizer steps done
    (metrics.jsonl step + 1), the axis of eval.jsonl and of checkpoint directories. A run resumed after k
    steps marks a restart at k + 1, so TensorBoard hides the earlier session's events from there on (those
    steps are trained again, as `run_log.truncate_logs` drops their lines); a fresh start hides all earlier ones."""

    def __init__(self, report_to: list[str], out: Path, rank: int, resumed_at: int | None):
        self.writer, self.directory, self._hook = None, out / TENSORBOARD_DIR, None
        if rank == 0 and "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            purge = 0 if resumed_at is None else resumed_at + 1
            try:
                self.writer = SummaryWriter(log_dir=str(self.directory), purge_step=purge)
            except OSError as e:
                raise WriteError(_cannot_write(self.directory, e)) from None

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
        try:
            for name, value in scalars.items():
                if value is not None:  # not finite: metrics.jsonl says null, TensorBoard gets no point
                    self.writer.add_scalar(name, value, step, walltime=walltime)
            self.writer.flush()  # a running run is visible step by step
        except OSError as e:  # raised here, or by the writer's thread and raised again here
            raise WriteError(_cannot_write(self.directory, e)) from None

    def __enter__(self):
        # the event writer's thread re-raises its OSError in _write, named; threading's hook would also
        # print that thread's traceback, so it is kept quiet for the writer's threads only
        previous = self._hook = threading.excepthook

        def hook(args):
            if not (self.writer is not None and type(args.thread).__module__.startswith("tensorboard.")):
                previous(args)

        threading.excepthook = hook
        return self

    def __exit__(self, kind, *exc) -> None:
        try:
            if self.writer is not None:
                self.writer.close()
        except OSError as e:
            if kind is None:  # else the error already under way is the one to report
                raise WriteError(_cannot_write(self.directory, e)) from None
        finally:
            threading.excepthook = self._hook or threading.excepthook
