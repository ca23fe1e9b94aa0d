"""What `dpo-state report` shows of a run: a summary and every series, read from the run directory only."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from dpo_state.errors import DocumentError, ToolkitError
from dpo_state.layout import list_checkpoints
from dpo_state.run_logs import EVAL_LOG, METRICS_LOG, by_step, current_eval, current_metrics, read_log, step_scalars
from dpo_state.sidecar_record import read_sidecar_record
from dpo_state.strict_yaml import read_yaml_file

REPORT_FORMAT_VERSION = 4
"""`dpo-state report --json` prints one document of this version; schema `run-report`. 2: eval `loss`, `nll`;
3: series `loss` is the optimized objective (None for steps logged before metrics format 3), `pair_loss` its
pair part (`sources/NAME/pair_loss` per source), eval `pair_loss`; 4: eval `margin` (the raw log-ratio margin)
is `logratio_margin`, and eval `rewards/margins` is TRL's, beta-scaled (None for records before eval format 4)."""

FILL_EDGES = [b / 10 for b in range(11)]
"""The bins of the trainer's micro-batch fill histogram (dpo_train.step.metrics.FILL_BINS)."""

CHARTED_SOURCES = 12
"""sources.png draws this many sources, those with the most pairs (ties by name); the rest are listed."""

CONFIG = "config.resolved.yaml"


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
    steps = by_step([current_metrics(r) for r in metrics.records])  # old and new formats, one naming
    if not steps:
        raise DocumentError(f"{metrics_log} holds no finished step yet; run the report again after the first step")
    evals = read_log(run / EVAL_LOG) if (run / EVAL_LOG).is_file() else None
    torn = [name for name, log in ((METRICS_LOG, metrics), (EVAL_LOG, evals)) if log and log.torn]
    eval_steps = by_step([current_eval(r) for r in evals.records]) if evals else []  # one naming, as for steps
    return {
        "format_version": REPORT_FORMAT_VERSION,
        "summary": _summary(run, steps, eval_steps, torn),
        "series": _series(steps),
        "sources": _sources(steps),
        "eval": _eval_series(eval_steps),
        "microbatches": _microbatches(steps),
    }


def _summary(run: Path, steps: list[dict], evals: list[dict], torn: list[str]) -> dict[str, Any]:
    config, problems = _resolved_config(run)
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
    path = _config_field(config, "model", "path", (str,), "a string", problems)
    init = _config_field(config, "model", "init", (dict,), "a mapping", problems)
    return {
        "run": str(run),
        "model": path or ("random init" if init else None),
        "lora": _config_field(config, "model", "lora", (dict,), "a mapping", problems),
        "dataset": _dataset(identity, config, problems),
        "steps": len(steps),
        "last_step": steps[-1]["step"],
        "max_steps": _config_field(config, "train", "max_steps", (int,), "an integer", problems),
        "finished": (run / "final").is_dir(),
        "pairs": sum(r["pairs"] for r in steps),
        "wall_seconds": _finite(_wall_seconds(steps)),
        "train_seconds": _finite(sum(_seconds(r) for r in steps)),
        "precompute": _precompute(config, identity, problems),
        "eval_before": evals[0] if evals and evals[0]["step"] == 0 else None,
        "eval_final": trained[-1] if trained else None,
        "eval_best": best,
        "checkpoints": [step for step, _ in checkpoints],
        "releases": _releases(checkpoints),
        "identity": identity,
        "identity_error": identity_error,
        "torn_last_lines": torn,
        "config_problems": problems,
    }


def _releases(checkpoints: list[tuple[int, Path]]) -> list[dict]:
    """The releases the run trained on, as its committed checkpoints on disk record them (state.json's
    `environment`): an entry at the first checkpoint of each change (a resume under another torch). Empty
    without a checkpoint, or where they were written before the record; a checkpoint that does not read is
    left out (the identity row names the latest's problem)."""
    from dpo_state.state import read_state

    changes: list[dict] = []
    for step, path in checkpoints:
        try:
            environment = read_state(path).get("environment")
        except ToolkitError:
            continue
        if environment and (not changes or changes[-1]["environment"] != environment):
            changes.append({"from_step": step, "environment": environment})
    return changes


def _resolved_config(run: Path) -> tuple[dict, list[str]]:
    """OUTPUT/config.resolved.yaml through the strict YAML reader, or {} when absent (a report still draws
    the logs); with the problem named when it is not a mapping of sections."""
    path = run / CONFIG
    if not path.exists():
        return {}, []
    try:
        config = read_yaml_file(path)
    except DocumentError as e:
        raise DocumentError(f"{e}. Fix: restore {CONFIG} as dpo-train wrote it, or move it aside") from None
    if isinstance(config, dict):
        return config, []
    return {}, [f"{CONFIG} holds {_shown(config)}, not a mapping of sections: every config field is unknown"]


def _config_field(config: dict, section: str, key: str, types: tuple, kind: str, problems: list[str]) -> Any:
    """config[section][key] when absent or JSON data of `types`; otherwise None, the problem appended: a
    report is a reading tool, so a damaged or hand-edited config makes its field unknown, not the report fail."""
    part = config.get(section)
    if part is None:
        return None
    if not isinstance(part, dict):
        _add(problems, f"{CONFIG}: {section} is {_shown(part)}, not a mapping: its fields are unknown")
        return None
    value = part.get(key)
    if not isinstance(value, types) or isinstance(value, bool):
        if value is not None:
            _add(problems, f"{CONFIG}: {section}.{key} is {_shown(value)}, not {kind}: shown as unknown")
        return None
    if not _json_data(value):
        _add(problems, f"{CONFIG}: {section}.{key} holds a date, bytes, a set or .inf/.nan: shown as unknown")
        return None
    return value


def _add(problems: list[str], problem: str) -> None:
    if problem not in problems:  # a section that is not a mapping is met once per field read from it
        problems.append(problem)


def _shown(value: Any) -> str:
    return f"{value!r:.80} ({type(value).__name__})"


def _json_data(value: Any) -> bool:
    """Plain JSON: what YAML reads beyond it (dates, bytes, sets, .inf) cannot be printed by --json."""
    if isinstance(value, dict):
        return all(isinstance(k, str) and _json_data(v) for k, v in value.items())
    if isinstance(value, list):
        return all(map(_json_data, value))
    if isinstance(value, float):
        return math.isfinite(value)
    return value is None or isinstance(value, (str, int))


def _dataset(identity: dict | None, config: dict, problems: list[str]) -> dict:
    if identity is not None:
        return {"fingerprint": identity["dataset"]["fingerprint"], "pairs": identity["dataset"]["num_pairs"]}
    path = _config_field(config, "data", "path", (str, list), "a string or a list of strings", problems)
    return {"fingerprint": None, "pairs": None, "path": path}


def _precompute(config: dict, identity: dict | None, problems: list[str]) -> dict | None:
    """The reference precompute of a run that read a precomputed sidecar (reference.mode precomputed): the
    sidecar's directory and the wall time its reference.json records; `seconds` None and `unknown` saying why
    where it cannot be known. None for any other reference."""
    if _config_field(config, "reference", "mode", (str,), "a string", problems) != "precomputed":
        return None
    path = _config_field(config, "reference", "path", (str,), "a string", problems)
    if path is None:
        return {"sidecar": None, "seconds": None, "unknown": f"{CONFIG} names no reference.path"}
    try:
        record = read_sidecar_record(path)
    except (DocumentError, OSError) as e:  # a sidecar moved, removed or damaged since: the charts still draw
        return {"sidecar": path, "seconds": None, "unknown": f"its sidecar cannot be read: {e}"}
    used = identity["reference"].get("sidecar_table") if identity else None
    if used is not None and used != record["table"]["sha256"]:
        why = "the sidecar there was recomputed after this run (its table is not the one the run's checkpoints name)"
        return {"sidecar": path, "seconds": None, "unknown": why}
    seconds = record.get("seconds")
    why = None if seconds is not None else "the sidecar was written before the precompute's time was recorded"
    return {"sidecar": path, "seconds": seconds, "unknown": why}


def _finite(value: float) -> float | None:
    """A total of logged numbers (at most 1.8e308 each) can overflow: then it is unknown, not `Infinity`."""
    return value if math.isfinite(value) else None


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
    source absent from the step, a value not finite, a field older records do not have, or a per-source
    value that is not a number, which the metrics schema allows)."""
    flat = [step_scalars(r) for r in steps]
    names = sorted({name for scalars in flat for name in scalars})
    series = {"step": [r["step"] for r in steps], "time": [r.get("time") for r in steps]}
    series.update({name: [_number(scalars.get(name)) for scalars in flat] for name in names})
    return series


def _number(value: Any) -> int | float | None:
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _sources(steps: list[dict]) -> list[dict[str, Any]]:
    """Every source with its pairs over the run, most first (ties by name); the first CHARTED_SOURCES are
    drawn. Names are taken from the records, never re-parsed from `sources/NAME/KEY` (a name may hold `/`)."""
    pairs: dict[str, int] = {}
    for record in steps:
        for name, values in record["sources"].items():
            p = values["pairs"]  # the schema requires it, of any type: only a count counts
            pairs[name] = pairs.get(name, 0) + (p if isinstance(p, int) and not isinstance(p, bool) and p > 0 else 0)
    ranked = sorted(pairs, key=lambda name: (-pairs[name], name))
    return [{"name": n, "pairs": pairs[n], "charted": k < CHARTED_SOURCES} for k, n in enumerate(ranked)]


def _eval_series(evals: list[dict]) -> dict[str, list]:
    keys = ("step", "pairs", "accuracy", "ties", "rewards/margins", "logratio_margin", "logp_accuracy", "loss")
    keys += ("pair_loss", "nll")
    return {key: [r.get(key) for r in evals] for key in keys}  # None before the format that added it


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
