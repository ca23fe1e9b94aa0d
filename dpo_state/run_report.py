"""What `dpo-state report` shows of a run: a summary and every series, read from the run directory only."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from dpo_state.errors import DocumentError, ToolkitError
from dpo_state.layout import list_checkpoints
from dpo_state.run_logs import EVAL_LOG, METRICS_LOG, by_step, read_log, step_scalars

REPORT_FORMAT_VERSION = 1
"""`dpo-state report --json` prints one document of this version; schema `run-report`."""

FILL_EDGES = [b / 10 for b in range(11)]
"""The bins of the trainer's micro-batch fill histogram (dpo_train.metrics.FILL_BINS)."""


def run_report(run_dir: str | Path) -> dict[str, Any]:
    """The summary and the series of a run: finished, running (a torn last line is left out), resumed
    (each step once) or stopped; without eval.jsonl the eval series are empty."""
    run = Path(run_dir)
    metrics_log = run / METRICS_LOG
    if not metrics_log.is_file():
        raise DocumentError(
            f"{run} has no {METRICS_LOG}: give a dpo-train output directory (train.output_dir) in which at "
            "least one optimizer step has finished"
        )
    metrics = read_log(metrics_log)
    steps = by_step(metrics.records)
    if not steps:
        raise DocumentError(f"{metrics_log} holds no finished step yet; run the report again after the first step")
    evals = read_log(run / EVAL_LOG) if (run / EVAL_LOG).is_file() else None
    torn = [name for name, log in ((METRICS_LOG, metrics), (EVAL_LOG, evals)) if log and log.torn]
    eval_steps = by_step(evals.records) if evals else []
    return {
        "format_version": REPORT_FORMAT_VERSION,
        "summary": _summary(run, steps, eval_steps, torn),
        "series": _series(steps),
        "eval": _eval_series(eval_steps),
        "microbatches": _microbatches(steps),
    }


def _summary(run: Path, steps: list[dict], evals: list[dict], torn: list[str]) -> dict[str, Any]:
    config = _resolved_config(run)
    checkpoints = list_checkpoints(run).committed
    identity, identity_error = None, None
    if checkpoints:
        from dpo_state.audit import inspect_checkpoint

        try:
            identity = inspect_checkpoint(checkpoints[-1][1])["identity"]
        except ToolkitError as e:  # a damaged checkpoint is reported, the charts are still drawn
            identity_error = str(e)
    trained = [r for r in evals if r["step"] > 0]
    best = max(trained, key=lambda r: r["accuracy"] if r["accuracy"] is not None else -1.0, default=None)
    model = config.get("model", {})
    return {
        "run": str(run),
        "model": model.get("path") or ("random init" if model.get("init") else None),
        "lora": model.get("lora"),
        "dataset": _dataset(identity, config),
        "steps": len(steps),
        "last_step": steps[-1]["step"],
        "max_steps": config.get("train", {}).get("max_steps"),
        "finished": (run / "final").is_dir(),
        "pairs": sum(r["pairs"] for r in steps),
        "wall_seconds": _wall_seconds(steps),
        "train_seconds": sum(_seconds(r) for r in steps),
        "eval_before": evals[0] if evals and evals[0]["step"] == 0 else None,
        "eval_final": trained[-1] if trained else None,
        "eval_best": best,
        "checkpoints": [step for step, _ in checkpoints],
        "identity": identity,
        "identity_error": identity_error,
        "torn_last_lines": torn,
    }


def _resolved_config(run: Path) -> dict:
    """OUTPUT/config.resolved.yaml, or {} when absent (a report still draws the logs)."""
    path = run / "config.resolved.yaml"
    if not path.is_file():
        return {}
    try:
        config = yaml.safe_load(path.read_text())
    except (yaml.YAMLError, UnicodeDecodeError) as e:
        raise DocumentError(f"{path} is not YAML ({e}); restore it, or move it aside to report without it") from None
    return config if isinstance(config, dict) else {}


def _dataset(identity: dict | None, config: dict) -> dict:
    if identity is not None:
        return {"fingerprint": identity["dataset"]["fingerprint"], "pairs": identity["dataset"]["num_pairs"]}
    return {"fingerprint": None, "pairs": None, "path": config.get("data", {}).get("path")}


def _seconds(record: dict) -> float:
    """The step's own time, from its pair rate (pairs / (pairs/s))."""
    return record["pairs"] / record["pairs/s"] if record.get("pairs/s") else 0.0


def _wall_seconds(steps: list[dict]) -> float:
    """From the first step's start to the last step's end (pauses between a crash and the resume included);
    records before metrics format 2 carry no time: then the sum of step times."""
    if "time" in steps[0] and "time" in steps[-1]:
        return steps[-1]["time"] - steps[0]["time"] + _seconds(steps[0])
    return sum(_seconds(r) for r in steps)


def _series(steps: list[dict]) -> dict[str, list]:
    """`step`, `time`, and every scalar of `step_scalars`, aligned by step (None where a step lacks it: a
    source absent from the step, a value not finite, a field older records do not have)."""
    flat = [step_scalars(r) for r in steps]
    names = sorted({name for scalars in flat for name in scalars})
    series = {"step": [r["step"] for r in steps], "time": [r.get("time") for r in steps]}
    series.update({name: [scalars.get(name) for scalars in flat] for name in names})
    return series


def _eval_series(evals: list[dict]) -> dict[str, list]:
    keys = ("step", "pairs", "accuracy", "ties", "margin", "logp_accuracy")
    return {key: [r[key] for r in evals] for key in keys}


def _microbatches(steps: list[dict]) -> dict[str, Any]:
    """The fill histogram summed over the run, and tokens per micro-batch per step (records of metrics
    format 2; older ones carry neither)."""
    recorded = [r for r in steps if "fill_histogram" in r]
    counts = [sum(col) for col in zip(*(r["fill_histogram"] for r in recorded))] if recorded else []
    return {
        "fill_edges": FILL_EDGES,
        "fill_counts": counts,
        "step": [r["step"] for r in recorded],
        "tokens_per_microbatch": [r["input_tokens"] / r["microbatches"] if r["microbatches"] else 0 for r in recorded],
    }
