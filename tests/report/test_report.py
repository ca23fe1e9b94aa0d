"""`dpo-state report` and the TensorBoard sink on a real run of the tiny model: several sources, held-out eval,
a crash and a resume; then the report on a running run, a run without eval, and broken logs."""

from __future__ import annotations

import json
import math
import re
import shutil
import sys

import pytest

from tests.harness import state_here
from tests.train.checkpoint.test_checkpoint import config, train


@pytest.fixture(scope="module")
def run(sample_dataset, small_dataset, smollm2_dir, tmp_path_factory):
    """6 steps over the sample's 6 sources, eval every 2 steps, checkpoints every 2; the first attempt fails
    reading step 3 and the second resumes from step 2. TensorBoard on."""
    tmp = tmp_path_factory.mktemp("report")
    path, out = config(
        tmp,
        sample_dataset,
        smollm2_dir,
        "run",
        train__max_steps=6,
        train__save_every=2,
        train__keep_last=3,
        train__report_to=["tensorboard"],
        eval__path=str(small_dataset),
        eval__every=2,
    )
    failed = train(path, env={"DPO_TRAIN_FAULT": "0:3"}, check=None)
    assert failed.returncode != 0 and "injected fault" in failed.stderr
    assert [json.loads(x)["step"] for x in (out / "metrics.jsonl").read_text().splitlines()] == [0, 1, 2]
    train(path)
    return out


def _records(out):
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def _report_json(run_cli, run_dir):
    """`dpo-state report RUN --json`, in this process (state_here: it reads files only), checked against its schema."""
    from dpo_state.schema import schema_problems

    proc = state_here(run_cli, "report", run_dir, "--json")
    report = json.loads(proc.stdout)
    assert schema_problems("run-report", report) == []
    return report


def _not_blank(png):
    from matplotlib.image import imread

    image = imread(png)  # decodes, or raises
    assert image.ndim == 3 and image.shape[0] > 200 and image.shape[1] > 200
    ink = (image[..., :3] < 0.85).any(axis=-1).mean()  # share of pixels that are not white-ish
    assert 0.01 < ink < 0.9, f"{png.name}: {ink:.3f} of the pixels drawn"


@pytest.mark.slow
def test_the_report_of_a_resumed_run_has_every_chart_and_each_step_once(run, tmp_path, run_cli):
    records = _records(run)
    assert [r["step"] for r in records] == list(range(6))
    proc = state_here(run_cli, "report", run, "--out", tmp_path / "r")
    page = tmp_path / "r" / "report.html"
    assert proc.stdout.strip() == str(page)
    pngs = sorted(p.name for p in (tmp_path / "r").glob("*.png"))
    assert pngs == ["eval.png", "sources.png", "throughput.png", "training.png"]
    for png in (tmp_path / "r").glob("*.png"):
        _not_blank(png)
    text = page.read_text()
    assert not re.search(r"(src|href)\s*=\s*['\"](?!data:)", text), "the page must fetch nothing"
    assert "http://" not in text and "https://" not in text
    assert text.count("data:image/png;base64,") == 4
    assert records[0]["sources"] and len({s for r in records for s in r["sources"]}) > 1
    # the layout: the summary, the charts (training first) at full width, the identity last and folded
    first_chart, identity = text.index("<h2>training</h2><img"), text.index("<details><summary>identity")
    assert text.index("<h2>eval</h2>") < text.index("<h2>throughput</h2>") and first_chart < identity
    assert "img{width:100%}" in text and text.count("<table>") == 2 and text.rindex("<table>") > identity
    above, below = text[:first_chart].count("<tr>"), text[identity:].count("<tr>")
    assert above < 20 < below  # the short summary above the charts; the identity's many rows below them
    smooth = state_here(run_cli, "report", run, "--out", tmp_path / "s", "--smoothing", "0.8")
    assert (tmp_path / "s" / "training.png").read_bytes() != (tmp_path / "r" / "training.png").read_bytes()
    assert smooth.stdout.strip() == str(tmp_path / "s" / "report.html")
    assert (
        "--smoothing is 1.0; allowed: a number in [0, 1)"
        in state_here(run_cli, "report", run, "--smoothing", "1", code=2).stderr
    )

    report = _report_json(run_cli, run)
    series, summary = report["series"], report["summary"]
    assert series["step"] == [r["step"] for r in records]  # each step once, in order
    for i, record in enumerate(records):  # every series equals metrics.jsonl
        for key in ("loss", "rewards/accuracies", "rewards/margins", "grad_norm", "lr", "pairs/s", "time"):
            assert series[key][i] == record[key]
        for source, values in record["sources"].items():
            for key, value in values.items():
                assert series[f"sources/{source}/{key}"][i] == value
    assert summary["steps"] == 6 and summary["checkpoints"] == [2, 4, 6] and summary["finished"]
    assert summary["pairs"] == 24 and summary["identity"]["dataset"]["num_pairs"] == summary["dataset"]["pairs"]
    assert report["eval"]["step"] == [0, 2, 4, 6]  # the crashed attempt's step-2 eval was dropped on resume
    assert summary["eval_final"]["step"] == 6
    mb = report["microbatches"]
    assert sum(mb["fill_counts"]) == sum(r["microbatches"] for r in records) > 0


@pytest.mark.slow
def test_tensorboard_events_equal_metrics_jsonl_after_the_resume(run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dpo_state.run_logs import step_scalars

    events = EventAccumulator(str(run / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    records = _records(run)
    expected = {}
    for record in records:
        for name, value in step_scalars(record).items():
            if value is not None:
                expected.setdefault(name, []).append((record["step"] + 1, value))  # axis: steps done
    assert any(name.startswith("sources/") for name in expected)
    tags = set(events.Tags()["scalars"])
    assert set(expected) <= tags
    for name, points in expected.items():
        logged = [(e.step, e.value) for e in events.Scalars(name)]
        assert [s for s, _ in logged] == [s for s, _ in points], name  # the crashed session's step 2 is purged
        for (_, got), (_, want) in zip(logged, points):
            assert got == pytest.approx(want, rel=1e-6, abs=1e-30), name  # events hold float32
    assert [e.step for e in events.Scalars("eval/accuracy")] == [0, 2, 4, 6]


@pytest.mark.slow
def test_a_running_run_a_run_without_eval_and_bad_logs(run, tmp_path, run_cli):
    copy = tmp_path / "running"
    shutil.copytree(run, copy, ignore=shutil.ignore_patterns("checkpoints", "final", "tensorboard", "report"))
    with open(copy / "metrics.jsonl", "a") as f:
        f.write('{"format_version": 2, "step": 6, "lo')  # the trainer mid-write
    (copy / "eval.jsonl").unlink()
    report = _report_json(run_cli, copy)
    assert report["series"]["step"] == list(range(6)) and report["summary"]["torn_last_lines"] == ["metrics.jsonl"]
    assert report["eval"]["step"] == [] and report["summary"]["eval_final"] is None
    assert report["summary"]["checkpoints"] == [] and not report["summary"]["finished"]
    state_here(run_cli, "report", copy)
    assert not (copy / "report" / "eval.png").exists()
    assert "No held-out evaluation" in (copy / "report" / "report.html").read_text()

    lines = (copy / "metrics.jsonl").read_text().splitlines()
    (copy / "metrics.jsonl").write_text("\n".join([lines[0], "{not json", *lines[1:]]))
    proc = state_here(run_cli, "report", copy, "--json", code=2)
    assert "metrics.jsonl line 2 is not JSON" in proc.stderr and "Traceback" not in proc.stderr
    (copy / "metrics.jsonl").write_text(json.dumps({"step": 0, "loss": 1.0}) + "\n")
    proc = state_here(run_cli, "report", copy, code=2)
    assert "schemas/metrics-record.schema.json" in proc.stderr
    (copy / "metrics.jsonl").write_text("")
    proc = state_here(run_cli, "report", copy, code=2)
    assert "holds no finished step" in proc.stderr
    proc = state_here(run_cli, "report", tmp_path / "nowhere", code=2)
    assert "has no metrics.jsonl" in proc.stderr


def test_a_step_logged_twice_is_reported_once_with_the_later_line(tmp_path):
    """A log carried across a crash by a trainer that did not truncate it: the continued run's line wins."""
    from dpo_report.summary import run_report
    from dpo_state.schema import schema_problems

    def record(step, loss):
        return {
            "format_version": 1,
            "step": step,
            "world_size": 1,
            **{k: loss for k in ("loss", "rewards/chosen", "rewards/rejected", "rewards/accuracies")},
            **{k: 0.0 for k in ("rewards/margins", "logps/chosen", "logps/rejected", "nll", "grad_norm", "lr")},
            **{"packing_efficiency": 0.5, "pairs/s": 2.0, "tokens/s": 20.0},
            **{"pairs": 4, "input_tokens": 40, "supervised_tokens": 20, "skipped_steps": 0, "sources": {}},
        }

    lines = [record(0, 0.7), record(1, 0.6), record(2, 9.0), record(1, 0.5), record(2, 0.4), record(3, 0.3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    report = run_report(tmp_path)
    assert schema_problems("run-report", report) == []
    assert report["series"]["step"] == [0, 1, 2, 3]
    assert report["series"]["pair_loss"] == [0.7, 0.5, 0.4, 0.3]  # format 1's loss: the pair part
    assert report["summary"]["wall_seconds"] == pytest.approx(8.0)  # format 1: no time, the sum of 2 s steps
    assert report["microbatches"]["fill_counts"] == []  # format 1 records carry no histogram
    assert math.isclose(report["summary"]["train_seconds"], 8.0)


def _metrics_line(version: int, step: int, loss: float, pair_loss: float, source_loss: float) -> dict:
    """A metrics.jsonl record of `version`: 2 names the pair part `loss` (step and source), 3 logs the
    objective as `loss` and the pair part as `pair_loss`."""
    record = {
        "format_version": version,
        "step": step,
        "world_size": 1,
        **{k: 0.0 for k in ("rewards/chosen", "rewards/rejected", "rewards/accuracies", "rewards/margins")},
        **{k: 0.0 for k in ("logps/chosen", "logps/rejected", "grad_norm", "lr")},
        **{"nll": 10.0, "packing_efficiency": 0.5, "pairs/s": 2.0, "tokens/s": 20.0, "time": 100.0 + step},
        **{"pairs": 4, "input_tokens": 40, "supervised_tokens": 20, "skipped_steps": 0},
        **{"microbatches": 1, "fill_histogram": [0] * 9 + [1]},
    }
    if version == 2:
        return {**record, "loss": pair_loss, "sources": {"s": {"pairs": 4, "loss": source_loss}}}
    return {**record, "loss": loss, "pair_loss": pair_loss, "sources": {"s": {"pairs": 4, "pair_loss": source_loss}}}


def test_a_log_written_before_the_objective_was_logged_reads_in_todays_names(tmp_path):
    """A run resumed across the change: steps 0-1 in format 2 (loss: the pair part), 2-3 in format 3 (loss:
    the objective, 0.69 + 0.5 x 10 with sft weighed 0.5). The report's `loss` is the objective where it was
    logged and unknown (None) where it was not; `pair_loss`, step and source, is the pair part throughout;
    the charts draw both."""
    from dpo_report.charts import write_report
    from dpo_report.summary import run_report
    from dpo_state.schema import schema_problems

    lines = [_metrics_line(2, k, 0.7 - k / 100, 0.7 - k / 100, 0.6) for k in (0, 1)]
    lines += [_metrics_line(3, k, 5.7 - k / 100, 0.7 - k / 100, 0.6) for k in (2, 3)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    report = run_report(tmp_path)
    assert schema_problems("run-report", report) == [] and report["format_version"] == 4
    series = report["series"]
    assert series["loss"][:2] == [None, None] and series["loss"][2:] == pytest.approx([5.68, 5.67])
    assert series["pair_loss"] == pytest.approx([0.7, 0.69, 0.68, 0.67])
    assert series["sources/s/pair_loss"] == [0.6] * 4 and "sources/s/loss" not in series
    write_report(tmp_path)
    _not_blank(tmp_path / "report" / "training.png")
    _not_blank(tmp_path / "report" / "sources.png")


def test_report_to_and_report_name_what_is_missing(monkeypatch, tmp_path):
    """An unknown sink is a config error; a missing optional package names the extra to install."""
    from dpo_report.charts import write_report
    from dpo_state.errors import ToolkitError
    from dpo_train.config.loading import load_config
    from dpo_train.errors import ConfigError
    from dpo_train.run.sinks import check_report_to

    with pytest.raises(ConfigError, match="report_to"):
        load_config({"train": {"report_to": ["mlflow"]}})
    assert load_config({"train": {"report_to": ["tensorboard"]}}).train.report_to == ["tensorboard"]
    monkeypatch.setitem(sys.modules, "tensorboard", None)  # as if not installed
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match=r"dpo-toolkit\[report\]"):
        check_report_to(["tensorboard"])
    check_report_to([])  # nothing asked, nothing needed
    with pytest.raises(ToolkitError, match=r"dpo-toolkit\[report\].*--json"):
        write_report(tmp_path)


def test_smoothing_is_tensorboards_debiased_moving_average_and_keeps_gaps():
    from dpo_report.charts import smoothed

    out = smoothed([1.0, 3.0, float("nan"), 3.0], 0.5)
    assert out[0] == 1.0  # debiased: the first value is itself
    assert out[1] == pytest.approx((0.5 * 0.5 * 1 + 0.5 * 3) / (1 - 0.25))
    assert math.isnan(out[2]) and out[3] == pytest.approx((0.5 * (0.25 * 1 + 0.5 * 3) + 0.5 * 3) / (1 - 0.125))
    assert smoothed([2.0, 4.0], 0.0) == [2.0, 4.0]


def _eval_line(step: int, accuracy: float) -> dict:
    record = {"format_version": 3, "step": step, "pairs": 8, "accuracy": accuracy, "ties": 0.0, "margin": 0.1}
    return record | {"logp_accuracy": accuracy, "loss": 0.69, "pair_loss": 0.69, "nll": 1.0}


@pytest.mark.parametrize(("evaluations", "joined"), [(2, False), (3, True)])
def test_evaluations_are_drawn_as_points_joined_only_when_they_make_a_series(tmp_path, evaluations, joined):
    """Before and after (two evaluations) are two markers, not a line that claims a trend between them; from
    three on the markers are joined."""
    from dpo_report.charts import _eval, _pyplot
    from dpo_report.summary import run_report

    lines = [_metrics_line(3, k, 0.7, 0.7, 0.6) for k in range(4)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    steps = [0, 4] if evaluations == 2 else [0, 2, 4]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(_eval_line(s, 0.5 + s / 10)) + "\n" for s in steps))
    plt = _pyplot()
    figure = _eval(plt, run_report(tmp_path))
    drawn = [line for ax in figure.axes for line in ax.lines]
    plt.close(figure)
    assert len(drawn) == 4  # accuracy twice (margin and policy log-probs), margin, loss
    assert {(line.get_marker(), line.get_linestyle()) for line in drawn} == {("o", "-" if joined else "None")}
    assert [list(line.get_xdata()) for line in drawn] == [steps] * 4


@pytest.mark.parametrize(
    ("steps", "shown"), [([], "none kept"), ([24], "1 kept (step 24)"), ([8, 16, 24], "3 kept (steps 8, 16, 24)")]
)
def test_the_checkpoints_row_counts_them_and_names_their_steps(steps, shown):
    from dpo_report.charts import _checkpoints

    assert _checkpoints(steps) == shown


def test_the_wall_time_of_a_precomputed_run_adds_the_precompute_its_sidecar_records(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    """--precompute-reference records its wall time in reference.json; the report of a run on that sidecar
    adds it to the run's own, and says why where it cannot (a sidecar recomputed since, written before the time
    was recorded, or gone); a live run's wall time is its training alone."""
    from dpo_report.charts import _summary_rows
    from dpo_report.summary import run_report
    from tests.harness import train_here
    from tests.train.reference.test_sidecar_guards import _precomputed_config

    path, sidecar = _precomputed_config(tmp_path, small_dataset, smollm2_dir)
    train_here(run_cli, path, "--precompute-reference")
    train_here(run_cli, path, "--set", "train.max_steps=2", "--set", "train.save_every=2")
    document = json.loads((sidecar / "reference.json").read_text())
    assert document["seconds"] > 0

    def wall(run):
        summary = run_report(run)["summary"]
        return summary["precompute"], dict(_summary_rows(summary))["wall time"], summary

    precompute, row, summary = wall(tmp_path / "run")
    assert precompute == {"sidecar": str(sidecar), "seconds": document["seconds"], "unknown": None}
    w, t, p = summary["wall_seconds"], summary["train_seconds"], document["seconds"]
    assert row == f"{w + p:.1f} s: reference precompute {p:.1f} s + training {w:.1f} s ({t:.1f} s in steps)"
    assert dict(_summary_rows(summary))["checkpoints"] == "1 kept (step 2)"

    recomputed = {**document, "table": {**document["table"], "sha256": "sha256:" + "1" * 64}}
    (sidecar / "reference.json").write_text(json.dumps(recomputed))
    precompute, row, _ = wall(tmp_path / "run")
    assert precompute["seconds"] is None and "recomputed after this run" in precompute["unknown"]
    assert row.startswith(f"training {w:.1f} s ({t:.1f} s in steps); reference precompute not counted")
    (sidecar / "reference.json").write_text(json.dumps({k: v for k, v in document.items() if k != "seconds"}))
    precompute, _, _ = wall(tmp_path / "run")
    assert precompute["unknown"] == "the sidecar was written before the precompute's time was recorded"
    (sidecar / "reference.json").unlink()
    precompute, _, _ = wall(tmp_path / "run")
    assert precompute["unknown"] == f"its sidecar cannot be read: {sidecar / 'reference.json'} is missing"

    live = ["--set", "reference.mode=live", "--set", f"train.output_dir={tmp_path / 'live'}"]
    train_here(run_cli, path, *live, "--set", "train.max_steps=1")
    precompute, row, summary = wall(tmp_path / "live")
    w, t = summary["wall_seconds"], summary["train_seconds"]
    assert precompute is None and row == f"training {w:.1f} s ({t:.1f} s in steps)"


def test_the_releases_row_names_what_the_run_trained_on_and_each_change(run, tmp_path, run_cli):
    """A resume under another torch shows in the report: the releases from the first checkpoint, then the
    change from the checkpoint that first recorded it."""
    from dpo_state.commit import write_commit
    from dpo_state.installed import environment

    copy = tmp_path / "run"
    shutil.copytree(run, copy)
    *earlier, last = sorted((copy / "checkpoints").iterdir())
    state = json.loads((last / "state.json").read_text())
    state["environment"]["torch"] = "2.99.0"
    (last / "state.json").write_text(json.dumps(state))
    write_commit(last, state["step"])
    first = int(earlier[0].name.removeprefix("step-"))
    releases = _report_json(run_cli, copy)["summary"]["releases"]
    assert releases == [
        {"from_step": first, "environment": environment()},
        {"from_step": state["step"], "environment": {**environment(), "torch": "2.99.0"}},
    ]
    state_here(run_cli, "report", copy, "--out", tmp_path / "page")
    page = (tmp_path / "page" / "report.html").read_text()
    assert f"torch {environment()['torch']}" in page and f"(checkpoints from step {first})" in page
    assert f"; from step {state['step']}: torch 2.99.0</td>" in page
