"""Hostile run directories for `dpo-state report`: bad configs, thousands of sources, odd names, extreme values."""

from __future__ import annotations

import io
import json

import pytest

from dpo_cli.state import main as dpo_state
from tests.harness import state_cli


def _record(step: int, sources: dict | None = None, **fields) -> dict:
    """A metrics.jsonl record of format 3 (the trainer's current one), `fields` replacing its values."""
    record = {
        "format_version": 3,
        "step": step,
        "world_size": 1,
        **dict.fromkeys(("loss", "pair_loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies", "nll"), 0.5),
        **dict.fromkeys(("rewards/margins", "logps/chosen", "logps/rejected", "grad_norm", "lr"), 0.1),
        **{"packing_efficiency": 0.5, "pairs/s": 2.0, "tokens/s": 20.0, "time": 1000.0 + 2 * step},
        **{"pairs": 4, "input_tokens": 40, "supervised_tokens": 20, "skipped_steps": 0, "microbatches": 1},
        "fill_histogram": [0] * 9 + [1],
        "sources": {"s": {"pairs": 4, "pair_loss": 0.5, "accuracy": 1.0}} if sources is None else sources,
    }
    record.update(fields)
    return record


def _run(path, records: list[dict], config: str | None = None):
    """A run directory holding `records` as metrics.jsonl (each valid against its schema, as the report
    requires) and, when given, `config` as config.resolved.yaml."""
    from dpo_state.schema import schema_problems

    path.mkdir()
    for record in records:
        assert schema_problems("metrics-record", record) == []
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    if config is not None:
        (path / "config.resolved.yaml").write_text(config)
    return path


def _strict_json(text: str):
    """Parse as standard JSON: `NaN` and `Infinity` (what Python's json writes for them) are refused."""

    def refuse(name):
        raise AssertionError(f"--json printed {name}, which is not JSON")

    return json.loads(text, parse_constant=refuse)


def _report_json(run_cli, run) -> dict:
    from dpo_state.schema import schema_problems

    result = run_cli(dpo_state, "report", run, "--json")
    assert result.exit_code == 0, result.output
    report = _strict_json(result.stdout)
    assert schema_problems("run-report", report) == []
    return report


def _report_html(run_cli, run) -> str:
    result = run_cli(dpo_state, "report", run)
    assert result.exit_code == 0, result.output
    assert result.stdout.strip() == str(run / "report" / "report.html")
    return (run / "report" / "report.html").read_text()


# -- config.resolved.yaml goes through the one strict YAML reader -------------------------------------------


def test_an_alias_bomb_in_the_resolved_config_is_refused_at_once(tmp_path):
    """Each level holds ten of the one before: expanded (by --json or the LoRA row) it is 10^6 strings; with
    more levels the report would never finish."""
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 6)]
    bomb = "model:\n  lora:\n" + "".join(f"    {line}\n" for line in levels)
    run = _run(tmp_path / "run", [_record(0)], bomb)
    proc = state_cli("report", run, "--json", code=2, timeout=60)  # a process of its own: a hang is killed
    assert proc.stdout == ""
    assert proc.stderr == (
        f"error: config file {run / 'config.resolved.yaml'}, line 3: the anchor &a0 is not allowed in a config "
        "(anchors and aliases can expand without bound); write the values out. Fix: restore config.resolved.yaml "
        "as dpo-train wrote it, or move it aside\n"
    )


@pytest.mark.parametrize(
    "text, error",
    [
        ("train: {max_steps: 5}\ntrain: {max_steps: 50}\n", "line 2: the key 'train' appears twice"),
        ("model: " + "[" * 40 + "]" * 40 + "\n", "line 1: values nested more than 32 levels deep"),
        ("model: {path: " + "x" * (1 << 20) + "}\n", "bytes, over 1048576; a config is a few KB"),
        (b"model: {path: \xff}\n", "is not UTF-8 text (byte 14)"),
        ("? [a, b]\n: 1\n", "line 1: a key that is a list is not allowed in a config"),
    ],
    ids=["duplicate-key", "deep", "oversized", "binary", "list-key"],
)
def test_the_resolved_config_is_read_strictly(tmp_path, run_cli, text, error):
    run = _run(tmp_path / "run", [_record(0)])
    config = run / "config.resolved.yaml"
    config.write_bytes(text if isinstance(text, bytes) else text.encode())
    result = run_cli(dpo_state, "report", run)
    assert result.exit_code == 2 and result.stdout == "" and not (run / "report" / "report.html").exists()
    assert result.stderr.startswith("error: ") and error in result.stderr
    assert result.stderr.endswith("Fix: restore config.resolved.yaml as dpo-train wrote it, or move it aside\n")


def test_a_resolved_config_that_is_a_directory_is_named(tmp_path, run_cli):
    run = _run(tmp_path / "run", [_record(0)])
    (run / "config.resolved.yaml").mkdir()
    result = run_cli(dpo_state, "report", run, "--json")
    assert result.exit_code == 2
    assert f"config file {run / 'config.resolved.yaml'} is a directory" in result.stderr


@pytest.mark.parametrize(
    "text, error",
    [
        (
            "? [a, b]\n: 1\n",
            "line 1: a key that is a list is not allowed in a config; keys are names: write the key as plain text",
        ),
        (
            "data: " + "[" * 100_000 + "]" * 100_000 + "\n",
            "line 1: values nested more than 32 levels deep; a config nests a few: flatten it",
        ),
    ],
    ids=["list-key", "deep"],
)
def test_dpo_train_reads_its_config_with_the_same_strict_reader(tmp_path, text, error):
    """dpo_train/config/strict_yaml.py is the same reader raising ConfigError (these two were a TypeError and a
    RecursionError there)."""
    from dpo_train.config.loading import load_config
    from dpo_train.errors import ConfigError

    path = tmp_path / "c.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"config file {path}, {error}"


# -- a config of the wrong shape: the report renders, the bad field named and unknown ----------------------

C = "config.resolved.yaml"
WHOLE = "not a mapping of sections: every config field is unknown"


@pytest.mark.parametrize(
    "text, problems, model, max_steps, draw",
    [
        (
            "model: 5\ntrain: {max_steps: 9}\n",
            [f"{C}: model is 5 (int), not a mapping: its fields are unknown"],
            None,
            9,
            1,
        ),
        (
            "model: {path: m}\ntrain: [1]\n",
            [f"{C}: train is [1] (list), not a mapping: its fields are unknown"],
            "m",
            None,
            0,
        ),
        ("[1, 2]\n", [f"{C} holds [1, 2] (list), {WHOLE}"], None, None, 0),
        ("just text\n", [f"{C} holds 'just text' (str), {WHOLE}"], None, None, 0),
        ("", [f"{C} holds None (NoneType), {WHOLE}"], None, None, 0),
        (
            "model: {path: 7, init: {config: {x: .nan}}, lora: 2024-01-01}\ndata: {path: {a: .inf}}\n"
            "train: {max_steps: true}\n",
            [
                f"{C}: model.path is 7 (int), not a string: shown as unknown",
                f"{C}: model.init holds a date, bytes, a set or .inf/.nan: shown as unknown",
                f"{C}: model.lora is datetime.date(2024, 1, 1) (date), not a mapping: shown as unknown",
                f"{C}: data.path is {{'a': inf}} (dict), not a string or a list of strings: shown as unknown",
                f"{C}: train.max_steps is True (bool), not an integer: shown as unknown",
            ],
            None,
            None,
            1,
        ),
        ("model: {path: m, lora: {r: 8}}\ntrain: {max_steps: 3}\n", [], "m", 3, 1),
    ],
    ids=["model-int", "train-list", "file-list", "file-string", "file-empty", "fields", "good"],
)
def test_config_sections_of_the_wrong_type_are_named_and_the_rest_renders(
    tmp_path, run_cli, text, problems, model, max_steps, draw
):
    """--json for each; the page (a few seconds of drawing) for three."""
    import html

    run = _run(tmp_path / "run", [_record(0), _record(1)], text)
    summary = _report_json(run_cli, run)["summary"]
    assert summary["config_problems"] == problems
    assert (summary["model"], summary["max_steps"], summary["steps"]) == (model, max_steps, 2)
    if draw:
        page = _report_html(run_cli, run)
        row = "; ".join(problems) + f". Fix: restore {C} as dpo-train wrote it" if problems else "none"
        assert f"<tr><th>config problems</th><td>{html.escape(row)}</td></tr>" in page


# -- sources: thousands of them, and any name ---------------------------------------------------------------


def test_two_thousand_sources_draw_the_twelve_largest_and_list_the_rest(tmp_path, run_cli):
    """Source k has k % 7 + 1 pairs per step: the twelve drawn are those with 7 (ties by name), the rest are
    listed with their pairs, in --json and on the page."""
    names = [f"src{k:04d}" for k in range(2000)]
    per_step = {n: k % 7 + 1 for k, n in enumerate(names)}
    sources = {n: {"pairs": p, "pair_loss": 0.5, "accuracy": 1.0, "margin": 0.1} for n, p in per_step.items()}
    run = _run(tmp_path / "run", [_record(step, sources) for step in range(3)])
    listed = _report_json(run_cli, run)["sources"]
    ranked = sorted(names, key=lambda n: (-per_step[n], n))
    assert listed == [{"name": n, "pairs": 3 * per_step[n], "charted": k < 12} for k, n in enumerate(ranked)]
    assert [x["name"] for x in listed[:12]] == [f"src{k:04d}" for k in range(6, 84, 7)]
    page = _report_html(run_cli, run)
    assert "2000 source(s); drawn: the 12 with the most pairs (ties by name); not drawn, 1988 (pairs trained):" in page
    rest = ", ".join(f"{x['name']} ({x['pairs']})" for x in listed[12:])
    assert f"<p class='rest'>{rest}</p>" in page


NAMES = ["a/b", "a/b/loss", "$x^$", r"$\frac{$", "_hidden", "", "new\nline", "<b>&", "sources", "é" * 60]


def test_every_source_name_renders_in_the_html_and_json(tmp_path, run_cli):
    sources = {n: {"pairs": 2, "pair_loss": 0.25, "accuracy": 0.5} for n in NAMES}
    run = _run(tmp_path / "run", [_record(0, sources), _record(1, sources)])
    report = _report_json(run_cli, run)
    assert sorted(x["name"] for x in report["sources"]) == sorted(NAMES)
    for name in NAMES:
        assert report["series"][f"sources/{name}/pair_loss"] == [0.25, 0.25]
    page = _report_html(run_cli, run)
    assert "10 source(s); drawn: the 10 with the most pairs (ties by name).</p>" in page
    assert "<b>&" not in page and "data:image/png;base64," in page


@pytest.mark.parametrize(
    "name, label",
    [
        ("a/b", "a/b"),  # `sources/a/b/pair_loss` was split at its first `/`: KeyError
        ("$x^$", r"\$x^\$"),  # mathtext: a parse error when drawn
        (r"$\frac{$", r"\$\frac{\$"),
        ("_hidden", "_hidden"),  # matplotlib leaves out a collected label starting with `_`
        ("", "(empty name)"),
        ("n" * 50, "n" * 39 + "\u2026"),
    ],
)
def test_a_source_name_is_its_own_legend_entry(tmp_path, name, label):
    """The legend of sources.png, in-process: each entry literal text, in rank order, the figure drawable."""
    import matplotlib.cbook

    from dpo_report.charts import _pyplot, _sources
    from dpo_report.summary import run_report

    sources = {
        name: {"pairs": 3, "pair_loss": 0.5, "accuracy": 1.0},
        "other": {"pairs": 1, "pair_loss": 0.7, "accuracy": 0.0},
    }
    plt = _pyplot()
    figure = _sources(plt, run_report(_run(tmp_path / "run", [_record(0, sources), _record(1, sources)])))
    try:
        for ax in figure.axes:
            texts = [t.get_text() for t in ax.get_legend().get_texts()]
            assert texts == [label, "other"]
            assert not any(matplotlib.cbook.is_math_text(t) for t in texts)
        figure.savefig(io.BytesIO(), format="png")  # draws every text
    finally:
        plt.close(figure)


# -- the extreme values the log schemas allow --------------------------------------------------------------


def test_extreme_values_the_schemas_allow_are_drawn_or_named_never_a_crash(tmp_path, run_cli):
    """Floats up to 1.8e308, integers up to 2^64 - 1 and per-source values of any type (the metrics schema
    requires only a source's `pairs`): totals that overflow are null, not `Infinity`; values matplotlib
    cannot place on an axis are left out with a note; non-numbers are null."""
    big = 2**64 - 1
    records = [
        _record(0, {"s": {"pairs": 2, "pair_loss": 1e308, "accuracy": "high", "margin": [1]}}, loss=1e308, time=-1e308),
        _record(
            1,
            {"s": {"pairs": "two", "pair_loss": -1e308, "accuracy": True}, "t": {"pairs": big, "pair_loss": {"a": 1}}},
            loss=-1e308,
            grad_norm=1.7e308,
            time=1e308,
            **{"pairs/s": 5e-324, "fill_histogram": [big] * 10, "input_tokens": big, "microbatches": big},
        ),
        _record(big, {"s": {"pairs": -5, "pair_loss": 0.5}}, lr=5e-324, time=1e308),
    ]
    run = _run(tmp_path / "run", records)
    report = _report_json(run_cli, run)
    summary, series = report["summary"], report["series"]
    assert summary["wall_seconds"] is None and summary["train_seconds"] is None
    assert summary["last_step"] == big and series["step"] == [0, 1, big]
    assert series["loss"] == [1e308, -1e308, 0.5] and series["lr"] == [0.1, 0.1, 5e-324]
    assert series["sources/s/pair_loss"] == [1e308, -1e308, 0.5]
    assert series["sources/s/accuracy"] == [None, None, None]  # "high", True: not numbers
    assert series["sources/s/margin"] == [None, None, None] and series["sources/t/pair_loss"] == [None, None, None]
    assert series["sources/s/pairs"] == [2, None, -5]
    assert report["sources"] == [
        {"name": "t", "pairs": big, "charted": True},
        {"name": "s", "pairs": 2, "charted": True},
    ]
    assert report["microbatches"]["fill_counts"] == [big] * 9 + [big + 2]  # past int64: drawn as floats
    page = _report_html(run_cli, run)
    assert "<tr><th>wall time</th><td>training ? s (overflow) (? s (overflow) in steps)</td></tr>" in page
    assert page.count("data:image/png;base64,") == 3


def test_values_beyond_the_plot_limit_are_left_out_and_counted_on_the_chart(tmp_path):
    from dpo_report.charts import _pyplot, _training
    from dpo_report.summary import run_report

    records = [_record(0, loss=1e308), _record(1, loss=-1e308), _record(2, loss=1.0)]
    plt = _pyplot()
    figure = _training(plt, run_report(_run(tmp_path / "run", records)))
    try:
        loss = figure.axes[0]
        assert [t.get_text() for t in loss.texts] == ["2 value(s) beyond \u00b11e+300 not drawn"]
        assert [t.get_text() for t in figure.axes[1].texts] == []
        figure.savefig(io.BytesIO(), format="png")
    finally:
        plt.close(figure)
