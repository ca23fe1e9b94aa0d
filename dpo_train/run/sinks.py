"""Optional metric sinks (`train.report_to`): the step scalars of metrics.jsonl also written as TensorBoard
events and/or to a W&B run."""

from __future__ import annotations

import contextlib
import importlib
import os
import threading
from pathlib import Path

from dpo_state.run_logs import step_scalars
from dpo_train.errors import ConfigError, WriteError
from dpo_train.run.wandb_sink import WandbRun, wandb_root

REPORT_TO = ("tensorboard", "wandb")
TENSORBOARD_DIR = "tensorboard"
_PACKAGES = {"tensorboard": "report", "wandb": "wandb"}
"""Each sink's package (torch's SummaryWriter needs tensorboard) and the extra that installs it."""
_FILES = {"tensorboard": "event files", "wandb": "run files"}


def check_report_to(report_to: list[str]) -> None:
    """Unknown sinks and a missing optional package fail before anything starts."""
    for sink in report_to:
        try:
            importlib.import_module(sink)
        except ImportError:
            raise ConfigError(
                f"train.report_to lists {sink}, but the {sink} package is not installed; install it "
                f"with `pip install 'dpo-toolkit[{_PACKAGES[sink]}]'`, or drop it from train.report_to"
            ) from None


def sink_directory(sink: str, out: Path) -> Path:
    """Where a sink writes: OUTPUT/tensorboard, or wandb's `wandb/` folder under WANDB_DIR (default OUTPUT)."""
    return out / TENSORBOARD_DIR if sink == "tensorboard" else wandb_root(out) / "wandb"


def check_sinks(report_to: list[str], out: Path) -> None:
    """Rank 0, before anything trains: each sink's directory is a directory (or can be made one) that takes
    a file. A file in its place is the user's to move (exit 2); a disk that refuses the write, exit 1."""
    for sink in report_to:
        _check_directory(sink, sink_directory(sink, out))


def _check_directory(sink: str, directory: Path) -> None:
    if directory.exists() and not directory.is_dir():
        elsewhere = "set WANDB_DIR elsewhere" if sink == "wandb" and os.environ.get("WANDB_DIR") else None
        raise ConfigError(
            f"train.report_to: {sink} writes its {_FILES[sink]} into {directory}, which is a file; move the "
            f"file away, or {elsewhere or 'set another train.output_dir'}"
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
        raise WriteError(_cannot_write(sink, directory, e)) from None


def _cannot_write(sink: str, directory: Path, e: OSError) -> str:
    return (
        f"train.report_to: {sink} cannot write its {_FILES[sink]} into {directory} ({e.strerror or e}); free "
        f"space or make the directory writable, or drop {sink} from train.report_to (metrics.jsonl holds "
        "the same scalars)"
    )


class MetricSinks:
    """Rank 0's sinks, on one axis of optimizer steps done (metrics.jsonl step + 1), the axis of eval.jsonl
    and of checkpoint directories, with each step's wall-clock time. TensorBoard events go to
    OUTPUT/tensorboard/. A run resumed after k steps marks a restart at k + 1, so TensorBoard hides the
    earlier session's events from there on (those steps are trained again, as `run_log.truncate_logs` drops
    their lines); a fresh start hides all earlier ones. The W&B run (`wandb_sink.WandbRun`) is continued on
    resume; wandb keeps the first point it got for a step (docs/report.md)."""

    def __init__(self, report_to: list[str], out: Path, rank: int, resumed_at: int | None):
        self.writer, self.directory, self._hook, self.wandb = None, out / TENSORBOARD_DIR, None, None
        if rank == 0 and "tensorboard" in report_to:
            from torch.utils.tensorboard import SummaryWriter

            purge = 0 if resumed_at is None else resumed_at + 1
            try:
                self.writer = SummaryWriter(log_dir=str(self.directory), purge_step=purge)
            except OSError as e:
                raise WriteError(_cannot_write("tensorboard", self.directory, e)) from None
        if rank == 0 and "wandb" in report_to:
            try:
                self.wandb = WandbRun(out, resumed_at)
            except BaseException:
                self._close_writer(failed=True)  # __exit__ does not run when __init__ fails
                raise

    def step(self, record: dict) -> None:
        """One metrics.jsonl record: every scalar under its metrics name (`sources/NAME/KEY` per source)."""
        self._write(step_scalars(record), record["step"] + 1, record.get("time"))

    def evaluation(self, record: dict) -> None:
        """One eval.jsonl record, under `eval/KEY`."""
        scalars = {f"eval/{k}": v for k, v in record.items() if k not in ("format_version", "step")}
        self._write(scalars, record["step"], None)

    def _write(self, scalars: dict, step: int, walltime: float | None) -> None:
        if self.wandb is not None:
            self.wandb.write(scalars, step, walltime)
        if self.writer is None:
            return
        try:
            for name, value in scalars.items():
                if value is not None:  # not finite: metrics.jsonl says null, TensorBoard gets no point
                    self.writer.add_scalar(name, value, step, walltime=walltime)
            self.writer.flush()  # a running run is visible step by step
        except OSError as e:  # raised here, or by the writer's thread and raised again here
            raise WriteError(_cannot_write("tensorboard", self.directory, e)) from None

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
            try:
                if self.wandb is not None:
                    self.wandb.close(failed=kind is not None)
            finally:
                self._close_writer(failed=kind is not None)
        finally:
            threading.excepthook = self._hook or threading.excepthook

    def _close_writer(self, failed: bool) -> None:
        try:
            if self.writer is not None:
                self.writer.close()
        except OSError as e:
            if not failed:  # else the error already under way is the one to report
                raise WriteError(_cannot_write("tensorboard", self.directory, e)) from None
