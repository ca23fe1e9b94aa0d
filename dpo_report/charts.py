"""`dpo-state report`'s output: PNG charts (matplotlib, no display) and one self-contained report.html."""

from __future__ import annotations

import base64
import html
import itertools
import json
import math
from pathlib import Path
from typing import Any

from dpo_report.summary import run_report
from dpo_state.errors import ToolkitError

REPORT_DIR = "report"
PNG_META = {"Software": None}  # no version string: a regenerated chart differs only when the run does
PLOT_LIMIT = 1e300  # matplotlib's ticks overflow on an axis spanning about 1e308; values beyond are not drawn
LABEL_CHARS = 40  # a source name is any string: its legend entry is cut to this many characters
EVAL_LINE_POINTS = 3
"""Evaluations are drawn as points, joined by a line from this many on: two (before and after) are not a trend."""


def write_report(run_dir: str | Path, out: str | Path | None = None, smoothing: float = 0.0) -> Path:
    """Draw the run's charts into `out` (default RUN_DIR/report) and write report.html there; return its path.
    `smoothing` in [0, 1): each step series also drawn as its exponential moving average with that weight
    (TensorBoard's slider; 0: none)."""
    if not 0.0 <= smoothing < 1.0:
        raise ToolkitError(f"--smoothing is {smoothing}; allowed: a number in [0, 1) (0: none); set it so")
    plt = _pyplot()
    report = run_report(run_dir)
    report["smoothing"] = smoothing  # read by _panel; not part of the --json document
    out = Path(out) if out is not None else Path(run_dir) / REPORT_DIR
    out.mkdir(parents=True, exist_ok=True)
    charts = {}
    for name, draw in (("training", _training), ("eval", _eval), ("throughput", _throughput), ("sources", _sources)):
        figure = draw(plt, report)
        if figure is None:
            continue
        figure.tight_layout()
        figure.savefig(out / f"{name}.png", dpi=90, metadata=PNG_META)
        plt.close(figure)
        charts[name] = out / f"{name}.png"
    page = out / "report.html"
    page.write_text(_html(report, charts))
    return page


def _pyplot():
    try:
        import matplotlib
    except ImportError:
        raise ToolkitError(
            "dpo-state report draws with matplotlib, which is not installed; install it with "
            "`pip install 'dpo-toolkit[report]'`, or use `dpo-state report --json`"
        ) from None
    matplotlib.use("Agg")  # files only: no display, no GUI toolkit
    import matplotlib.pyplot as plt

    return plt


def _drawable(value: float | None) -> bool:
    return value is not None and abs(value) <= PLOT_LIMIT  # False for NaN and inf too


def _values(values: list) -> list[float]:
    """None (not finite, or absent) becomes NaN: a gap in the line; so does a value beyond PLOT_LIMIT."""
    return [v if _drawable(v) else math.nan for v in values]


def _label(name: str) -> str:
    """A legend entry that shows `name` as written: `$` would start mathtext (a parse error, or other
    text drawn), so it is escaped; a long name is cut."""
    shown = name if len(name) <= LABEL_CHARS else name[: LABEL_CHARS - 1] + "\u2026"
    return (shown or "(empty name)").replace("$", r"\$")


def _steps_done(report: dict) -> list[int]:
    """Metrics record step k is the (k+1)-th optimizer step: the x axis counts steps done, as eval
    records and checkpoint directories do."""
    return [s + 1 for s in report["series"]["step"]]


def _panel(
    ax,
    report: dict,
    title: str,
    lines: dict[str, list],
    x: list | None = None,
    legend: bool | None = None,
    points: bool = False,
) -> None:
    """One chart of `lines` over steps done (or `x`). `points`: a few measurements (evaluations), drawn as
    markers, joined only from EVAL_LINE_POINTS on and never smoothed."""
    x = _steps_done(report) if x is None else x
    marker = "o" if points else "." if len(x) < 40 else None
    joined = not points or len(x) >= EVAL_LINE_POINTS
    smoothing = 0.0 if points else report.get("smoothing", 0.0)
    drawn = []
    for k, values in enumerate(lines.values()):  # dashed after the ten colours of matplotlib's cycle
        style = ("-" if k < 10 else "--") if joined else "none"
        if not smoothing:
            drawn.append(ax.plot(x, _values(values), marker=marker, linestyle=style)[0])
            continue
        raw = ax.plot(x, _values(values), linestyle=style, alpha=0.25)[0]  # faint: the values as logged
        drawn.append(ax.plot(x, smoothed(_values(values), smoothing), linestyle=style, color=raw.get_color())[0])
    for step in report["summary"]["checkpoints"]:
        ax.axvline(step, color="grey", linestyle=":", linewidth=1)
    beyond = sum(v is not None and not _drawable(v) for values in lines.values() for v in values)
    if beyond:  # said on the chart, so the gap is not read as a value the log lacks
        note = f"{beyond} value(s) beyond \u00b1{PLOT_LIMIT:.0e} not drawn"
        ax.text(0.01, 0.01, note, transform=ax.transAxes, fontsize=7)
    ax.set_title(title, fontsize=10)
    ax.set_xlabel("optimizer steps done (dotted: checkpoints)", fontsize=8)
    ax.grid(alpha=0.3)
    if drawn and (len(lines) > 1 if legend is None else legend):
        # handles and labels given: matplotlib would leave out a label starting with `_` if it collected them
        ax.legend(drawn, [_label(name) for name in lines], fontsize=7)


def smoothed(values: list[float], weight: float) -> list[float]:
    """TensorBoard's smoothing: the exponential moving average with `weight`, debiased at the start (so the
    first value is itself), over the finite values; a gap (nan) stays a gap and does not enter the mean."""
    out, mean, seen = [], 0.0, 0
    for value in values:
        if not math.isfinite(value):
            out.append(float("nan"))
            continue
        mean, seen = mean * weight + (1 - weight) * value, seen + 1
        out.append(mean / (1 - weight**seen))
    return out


def _training(plt, report: dict):
    s = report["series"]
    figure, axes = plt.subplots(4, 2, figsize=(16, 14))
    panels = [
        ("loss: the optimized objective", _loss_lines(s)),
        ("reward accuracy (chosen reward > rejected)", {"accuracy": s["rewards/accuracies"]}),
        ("reward margin (chosen - rejected)", {"margin": s["rewards/margins"]}),
        ("rewards", {"chosen": s["rewards/chosen"], "rejected": s["rewards/rejected"]}),
        ("policy log-probs per pair", {"chosen": s["logps/chosen"], "rejected": s["logps/rejected"]}),
        ("NLL of chosen tokens", {"nll": s["nll"]}),
        ("gradient norm (before clipping)", {"grad_norm": s["grad_norm"]}),
        ("learning rate", {"lr": s["lr"]}),
    ]
    for ax, (title, lines) in zip(axes.flat, panels):
        _panel(ax, report, title, lines)
    return figure


def _loss_lines(series: dict) -> dict[str, list]:
    """The objective, and its pair part where it differs (an NLL or router term is weighed in) or is all
    that an older log recorded (metrics format < 3: the objective is None there); of the step series or
    the eval series alike."""
    loss, pairs = series["loss"], series.get("pair_loss") or [None] * len(series["step"])
    if pairs == loss:
        return {"loss": loss}
    return {"loss": loss, "pair part (pair_loss)": pairs}


def _throughput(plt, report: dict):
    s, mb = report["series"], report["microbatches"]
    figure, axes = plt.subplots(2, 2, figsize=(16, 8))
    _panel(axes[0, 0], report, "pairs / s", {"pairs/s": s["pairs/s"]})
    _panel(axes[0, 1], report, "input tokens / s", {"tokens/s": s["tokens/s"]})
    ax = axes[1, 0]
    if mb["step"]:
        _panel(
            ax,
            report,
            "input tokens per micro-batch (mean of the step)",
            {"tokens": mb["tokens_per_microbatch"]},
            x=[k + 1 for k in mb["step"]],
        )
    else:
        _panel(ax, report, "packing efficiency (input tokens / capacity)", {"fill": s["packing_efficiency"]})
    ax = axes[1, 1]
    if mb["fill_counts"]:
        edges = mb["fill_edges"]
        counts = [float(c) for c in mb["fill_counts"]]  # a sum of logged ints can pass numpy's int64
        ax.bar(edges[:-1], counts, width=edges[1] - edges[0], align="edge", edgecolor="black")
        ax.set_xlabel("fill: input tokens / max_tokens_per_microbatch", fontsize=8)
        ax.set_ylabel("micro-batches", fontsize=8)
    else:
        ax.text(0.5, 0.5, "not recorded\n(metrics written before format 2)", ha="center", va="center")
    ax.set_title("micro-batch fill, whole run", fontsize=10)
    return figure


def _sources(plt, report: dict):
    """Per charted source (run_report.CHARTED_SOURCES), pair-weighted over a trailing window of steps (a
    source has a few pairs per step, so a single step's value is mostly noise), and its pairs so far."""
    s = report["series"]
    names = [source["name"] for source in report["sources"] if source["charted"]]
    window = min(50, max(1, round(len(s["step"]) / 5)))
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.5))

    def metric(name: str, key: str) -> list:  # a hand-written record may lack any key but pairs
        return s.get(f"sources/{name}/{key}") or [None] * len(s["step"])

    for ax, key in zip(axes[:2], ("pair_loss", "accuracy")):
        lines = {n: _windowed(metric(n, key), metric(n, "pairs"), window) for n in names}
        title = f"per source: {key}, pair-weighted over the last {window} step(s)"
        _panel(ax, report, title, lines, legend=True)
    cumulative = {n: list(itertools.accumulate(p or 0 for p in metric(n, "pairs"))) for n in names}
    _panel(axes[2], report, "per source: pairs trained so far", cumulative, legend=True)
    return figure


def _windowed(values: list, pairs: list, window: int) -> list:
    """sum(value x pairs) / sum(pairs) over the last `window` steps; None where the source had no pair."""
    weighted = [(v * p, p) if v is not None and p else (0.0, 0) for v, p in zip(values, pairs)]
    out = []
    for k in range(len(weighted)):
        num, den = map(sum, zip(*weighted[max(0, k - window + 1) : k + 1]))
        out.append(num / den if den else None)
    return out


def _eval(plt, report: dict):
    e = report["eval"]
    if not e["step"]:
        return None
    figure, axes = plt.subplots(1, 3, figsize=(16, 4.5))
    lines = {"margin > 0 (vs reference)": e["accuracy"], "chosen logp > rejected (policy)": e["logp_accuracy"]}
    _panel(axes[0], report, "held-out accuracy", lines, x=e["step"], points=True)
    margins = {"rewards/margins": e["rewards/margins"]}  # TRL's, beta-scaled: the training chart's meaning
    _panel(axes[1], report, "held-out reward margin (chosen - rejected)", margins, x=e["step"], points=True)
    _panel(axes[2], report, "held-out loss (the run's objective)", _loss_lines(e), x=e["step"], points=True)
    return figure


def _html(report: dict, charts: dict[str, Path]) -> str:
    """One page, full width: the summary table, the charts inlined as data: URLs (nothing fetched), then the
    identity, folded (a `<details>` a reader opens), so the first chart is near the top."""
    summary = report["summary"]
    rows = "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in _summary_rows(summary))
    ident = summary["identity"]
    identity = (
        "".join(f"<tr><th>{html.escape(k)}</th><td>{html.escape(v)}</td></tr>" for k, v in _flat(ident))
        if ident
        else f"<tr><td>{html.escape(summary['identity_error'] or 'no committed checkpoint')}</td></tr>"
    )
    images = "".join(
        f"<h2>{name}</h2><img alt='{name}' src='data:image/png;base64,{base64.b64encode(path.read_bytes()).decode()}'>"
        + (_sources_listed(report["sources"]) if name == "sources" else "")
        for name, path in charts.items()
    )
    if "eval" not in charts:
        images += "<h2>eval</h2><p>No held-out evaluation in this run (eval.path unset).</p>"
    return (
        "<!doctype html><html><head><meta charset='utf-8'>"
        f"<title>dpo-train run {html.escape(summary['run'])}</title>"
        "<style>body{font-family:sans-serif;margin:1em}table{border-collapse:collapse}"
        "th,td{border:1px solid #ccc;padding:2px 8px;text-align:left;font-size:13px}img{width:100%}"
        "summary{font-size:1.5em;font-weight:bold;margin:0.83em 0;cursor:pointer}</style>"
        f"</head><body><h1>Run {html.escape(summary['run'])}</h1><table>{rows}</table>{images}"
        f"<details><summary>identity (latest committed checkpoint)</summary><table>{identity}</table></details>"
        "</body></html>\n"
    )


def _sources_listed(sources: list[dict]) -> str:
    """Which sources the chart draws and, by name with their pairs, every one it does not."""
    charted = [x for x in sources if x["charted"]]
    text = f"<p>{len(sources)} source(s); drawn: the {len(charted)} with the most pairs (ties by name)"
    rest = [x for x in sources if not x["charted"]]
    if not rest:
        return text + ".</p>"
    names = ", ".join(f"{html.escape(x['name'])} ({x['pairs']})" for x in rest)
    return text + f"; not drawn, {len(rest)} (pairs trained):</p><p class='rest'>{names}</p>"


def _summary_rows(s: dict) -> list[tuple[str, str]]:
    def held_out(record):
        return (
            f"{record['accuracy']:.1%} at step {record['step']}" if record and record["accuracy"] is not None else "-"
        )

    dataset = s["dataset"]
    return [
        ("model", f"{s['model']}" + (f" + LoRA {json.dumps(s['lora'])}" if s["lora"] else "")),
        ("dataset", f"{dataset['fingerprint'] or dataset.get('path')} ({dataset['pairs'] or '?'} pairs)"),
        (
            "steps",
            f"{s['steps']} logged, last step {s['last_step'] + 1} of {s['max_steps'] or '?'}"
            + ("" if s["finished"] else " (no final/ yet: running or stopped)"),
        ),
        ("pairs trained", str(s["pairs"])),
        ("wall time", _wall_time(s)),
        (
            "held-out accuracy",
            f"{held_out(s['eval_before'])} before; final {held_out(s['eval_final'])}; best {held_out(s['eval_best'])}",
        ),
        ("checkpoints", _checkpoints(s["checkpoints"])),
        ("releases", _releases(s.get("releases", []))),
        ("incomplete last line", ", ".join(s["torn_last_lines"]) or "none"),
        (
            "config problems",
            "; ".join(s["config_problems"]) + ". Fix: restore config.resolved.yaml as dpo-train wrote it"
            if s["config_problems"]
            else "none",
        ),
    ]


def _wall_time(s: dict) -> str:
    """The run's wall time: with a precomputed reference, the precompute's too (the run could not start
    without it), each part named; a precompute of unknown time is said so, not counted as 0."""
    train = f"training {_secs(s['wall_seconds'])} ({_secs(s['train_seconds'])} in steps)"
    precompute = s.get("precompute")
    if precompute is None:
        return train
    if precompute["seconds"] is None:
        return f"{train}; reference precompute not counted, its time unknown: {precompute['unknown']}"
    total = None if s["wall_seconds"] is None else s["wall_seconds"] + precompute["seconds"]
    total = total if total is not None and math.isfinite(total) else None  # a hand-edited log's overflow
    return f"{_secs(total)}: reference precompute {_secs(precompute['seconds'])} + {train}"


def _releases(changes: list[dict]) -> str:
    """`python 3.11.7, torch 2.13.0+cpu, ... (checkpoints from step 2); from step 6: torch 2.14.1`: the first
    record whole, then each change by what changed."""
    if not changes:
        return "not recorded (no committed checkpoint, or written before the releases were recorded)"
    first = changes[0]["environment"]
    text = ", ".join(f"{k} {v}" for k, v in first.items()) + f" (checkpoints from step {changes[0]['from_step']})"
    for before, after in zip(changes, changes[1:]):
        moved = {k: v for k, v in after["environment"].items() if before["environment"].get(k) != v}
        text += f"; from step {after['from_step']}: " + ", ".join(f"{k} {v}" for k, v in moved.items())
    return text


def _checkpoints(steps: list[int]) -> str:
    """The committed checkpoints still on disk, counted, then their steps: `3 kept (steps 2, 4, 6)`."""
    if not steps:
        return "none kept"
    return f"{len(steps)} kept (step{'s' if len(steps) > 1 else ''} {', '.join(map(str, steps))})"


def _secs(seconds: float | None) -> str:
    """None: the logged times or rates overflow a float; beyond 1e9 s (a hand-edited log), in powers of ten."""
    if seconds is None:
        return "? s (overflow)"
    return f"{seconds:.1f} s" if abs(seconds) < 1e9 else f"{seconds:.3g} s"


def _flat(value: Any, prefix: str = "") -> list[tuple[str, str]]:
    """Nested identity as dotted rows; long lists (optimizer parameters) are counted, not listed."""
    if isinstance(value, dict):
        return [row for k, v in value.items() for row in _flat(v, f"{prefix}.{k}" if prefix else k)]
    if isinstance(value, list) and len(value) > 8:
        return [(prefix, f"{len(value)} entries")]
    return [(prefix, value if isinstance(value, str) else json.dumps(value))]
