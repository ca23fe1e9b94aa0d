"""A run's JSON-lines logs (metrics.jsonl, eval.jsonl): parsed strictly, a torn last line tolerated."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import orjson

from dpo_state.errors import DocumentError
from dpo_state.schema import schema_problems

METRICS_LOG, EVAL_LOG = "metrics.jsonl", "eval.jsonl"
LOG_SCHEMAS = {METRICS_LOG: "metrics-record", EVAL_LOG: "eval-record"}

OBJECTIVE_FORMAT = 3
"""The metrics.jsonl format (dpo_train.step.metrics.METRICS_FORMAT_VERSION) from which `loss` is the whole
optimized objective and `pair_loss` its pair part; before it, `loss` was the pair part alone."""

TRL_MARGIN_FORMAT = 4
"""The eval.jsonl format (dpo_train.evaluation.EVAL_FORMAT_VERSION) from which `rewards/margins` is TRL's (the
beta-scaled reward margin, as metrics.jsonl's) and the raw log-ratio margin is `logratio_margin`; before it, that
raw margin was `margin`."""

# The metrics that are not scalars of the step: written as series elsewhere (or not at all).
_NOT_SCALARS = {"format_version", "step", "time", "sources", "fill_histogram", "nonfinite_ranks", "skipped"}


@dataclass(frozen=True)
class LogLines:
    """The records of one log, in file order, and whether its last line was torn (being written, or cut
    by a crash)."""

    records: list[dict]
    raw: list[bytes]
    torn: bool


def read_log(path: str | Path) -> LogLines:
    """Every record of a run log, each checked against its schema. A last line that is not JSON is torn
    (a writer mid-line, or a crash mid-write) and left out; any other bad line is a named error."""
    path = Path(path)
    schema = LOG_SCHEMAS[path.name]
    lines = [x for x in path.read_bytes().splitlines() if x.strip()]
    records, raw, torn = [], [], False
    for number, line in enumerate(lines, 1):
        try:
            record = orjson.loads(line)
        except orjson.JSONDecodeError:
            if number == len(lines):
                torn = True
                break
            raise DocumentError(f"{path} line {number} is not JSON; the log was edited or damaged") from None
        problems = schema_problems(schema, record)
        if problems:
            raise DocumentError(
                f"{path} line {number} does not match schemas/{schema}.schema.json: {problems[0]}. Fix: restore "
                "the log as the trainer wrote it, or move it aside"
            )
        records.append(record)
        raw.append(line)
    return LogLines(records, raw, torn)


def by_step(records: list[dict]) -> list[dict]:
    """One record per step, in step order; where a step appears twice (a log written across a crash and a
    resume by a trainer that did not truncate it), the later line wins, as it is the run that continued."""
    return sorted({r["step"]: r for r in records}.values(), key=lambda r: r["step"])


def current_metrics(record: dict) -> dict:
    """A metrics record in today's names, whatever format wrote it: before OBJECTIVE_FORMAT, `loss` (the
    step's and each source's) was the pair part, so it becomes `pair_loss`, and the step's `loss`, the
    objective such a log did not record, is None (unknown, not the pair part under the objective's name)."""
    if record["format_version"] >= OBJECTIVE_FORMAT:
        return record
    sources = {name: _pair_loss_named(values) for name, values in record["sources"].items()}
    return {**record, "loss": None, "pair_loss": record["loss"], "sources": sources}


def current_eval(record: dict) -> dict:
    """An eval record in today's names, whatever format wrote it: before TRL_MARGIN_FORMAT, `margin` was the raw
    log-ratio margin, so it becomes `logratio_margin`, and `rewards/margins`, which such a record did not hold, is
    None (unknown, not the raw margin under TRL's name for a beta-scaled one)."""
    if record["format_version"] >= TRL_MARGIN_FORMAT:
        return record
    renamed = {("logratio_margin" if key == "margin" else key): value for key, value in record.items()}
    return {**renamed, "rewards/margins": None}


def _pair_loss_named(values: dict) -> dict:
    return {("pair_loss" if key == "loss" else key): value for key, value in values.items()}


def step_scalars(record: dict) -> dict[str, Any]:
    """The scalars of one metrics record, flat: `loss`, `rewards/chosen`, ..., `sources/NAME/pair_loss`. The one
    naming shared by `dpo-state report --json` and the TensorBoard sink. Values may be None (not finite)."""
    scalars = {k: v for k, v in record.items() if k not in _NOT_SCALARS}
    for name, values in record.get("sources", {}).items():
        scalars.update({f"sources/{name}/{k}": v for k, v in values.items()})
    return scalars
