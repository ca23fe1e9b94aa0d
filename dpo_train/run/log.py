"""The run's logs, one owner: metrics.jsonl, eval.jsonl and the `train.report_to` sinks, written by rank 0,
and on resume the lines of steps to be trained again dropped first."""

from __future__ import annotations

import contextlib
from pathlib import Path

import orjson

from dpo_data.progress import say
from dpo_state.run_logs import EVAL_LOG, METRICS_LOG, read_log
from dpo_train.run.setup import Run
from dpo_train.run.sinks import MetricSinks


class RunLog:
    """Rank 0 writes; every other rank's RunLog does nothing. `resumed_at` is the checkpoint's step, or
    None on a fresh start (whose directory may still hold an earlier run's logs: they are replaced)."""

    def __init__(self, run: Run, resumed_at: int | None):
        """`run` gives the output directory, this rank and `train.report_to` / `train.log_every`."""
        self.out, self.rank, self.report_to = run.out, run.rank, run.config.train.report_to
        self.writes, self.log_every, self.resumed_at = run.rank == 0, run.config.train.log_every, resumed_at
        self._stack, self._metrics, self.sinks = contextlib.ExitStack(), None, None

    def __enter__(self) -> RunLog:
        with self._stack as stack:  # closes what it opened if a later part fails
            if self.writes:
                self._replace_later_lines()
                self._metrics = stack.enter_context(open(self.out / METRICS_LOG, "ab"))
            self.sinks = stack.enter_context(MetricSinks(self.report_to, self.out, self.rank, self.resumed_at))
            self._stack = stack.pop_all()
        return self

    def _replace_later_lines(self) -> None:
        dropped = truncate_logs(self.out, self.resumed_at or 0)
        if dropped and self.resumed_at is None:
            say(f"warning: {self.out} held logs of an earlier run without a checkpoint to resume; they are replaced")

    def step(self, record: dict) -> None:
        """One optimizer step's record, every `train.log_every` steps."""
        if self._metrics is None or record["step"] % self.log_every:
            return
        self._metrics.write(orjson.dumps(record) + b"\n")
        self._metrics.flush()
        self.sinks.step(record)

    def evaluation(self, record: dict) -> None:
        """One held-out evaluation's record."""
        if not self.writes:
            return
        with open(self.out / EVAL_LOG, "ab") as f:
            f.write(orjson.dumps(record) + b"\n")
        self.sinks.evaluation(record)

    def __exit__(self, *exc) -> None:
        self._stack.__exit__(*exc)


def truncate_logs(out: Path, step: int) -> int:
    """Drop log lines of steps after the checkpoint at `step`: they are trained again (on a fresh start,
    step 0, all of them); a torn last line (a crash mid-write) goes too. Returns how many lines were dropped."""
    dropped = 0
    for name, keep in (
        (METRICS_LOG, lambda r: r["step"] < step),
        (EVAL_LOG, lambda r: r["step"] <= step and step > 0),
    ):
        path = out / name
        if path.is_file():
            log = read_log(path)
            kept = [line for record, line in zip(log.records, log.raw) if keep(record)]
            path.write_bytes(b"".join(x + b"\n" for x in kept))
            dropped += len(log.records) + log.torn - len(kept)
    return dropped
