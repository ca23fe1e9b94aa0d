"""Long stages say what they do in a log: a start line, timed lines (count, elapsed, ETA), a done line."""

from __future__ import annotations

import re

from dpo_data import progress
from dpo_data.progress import Stage


def test_a_stage_in_a_log_says_start_progress_with_eta_and_done(monkeypatch, capsys):
    """Ten micro-batches of 20 s each: a line at most every 30 s (after the 2nd, 4th, ... batch), the
    ETA from the mean so far, and the total time at the end; disabled, nothing."""
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    with Stage("precompute", total=10, unit="micro-batch") as stage:
        for _ in range(10):
            now[0] += 20.0
            stage.advance()
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == "precompute ..."
    assert lines[1] == "precompute: 2/10 micro-batch  elapsed 0:00:40  eta 0:02:40"
    assert [x.split()[1] for x in lines[1:-1]] == ["2/10", "4/10", "6/10", "8/10"]
    assert lines[-1] == "precompute: done in 0:03:20"
    with Stage("quiet", total=3, enabled=False) as stage:
        stage.advance()
    assert capsys.readouterr().err == ""


def test_a_failed_stage_does_not_say_done(capsys):
    try:
        with Stage("export"):
            raise OSError("disk full")
    except OSError:
        pass
    assert capsys.readouterr().err.splitlines() == ["export ..."]


def test_a_stage_without_a_total_counts_in_a_log(monkeypatch, capsys):
    """The build reads rows of unknown number: in a log it says how many so far, without an ETA."""
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    with Stage("build", unit="rows", bar=True) as stage:
        for _ in range(4):
            now[0] += 20.0
            stage.update(1000)
    assert capsys.readouterr().err.splitlines() == [
        "build ...",
        "build: 2000 rows  elapsed 0:00:40",
        "build: 4000 rows  elapsed 0:01:20",
        "build: done in 0:01:20",
    ]


def test_a_stage_that_counts_nothing_is_one_line_with_its_time(monkeypatch, capsys):
    """A start-up stage of 3.2 s: `name ...` when it starts, its time on the same line when it ends."""
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    with Stage("setup: loading the model"):
        assert capsys.readouterr().err == "setup: loading the model ..."  # shown while it runs
        now[0] += 3.2
    assert capsys.readouterr().err == " 3.2 s\n"


def test_a_note_inside_a_stage_ends_its_line_and_the_stage_says_its_time_apart(monkeypatch, capsys):
    now = [0.0]
    monkeypatch.setattr(progress.time, "monotonic", lambda: now[0])
    with Stage("setup: verifying 2 datasets"):
        progress.say("note: a dataset was built with --chat-template")
        now[0] += 75.0
    assert capsys.readouterr().err.splitlines() == [
        "setup: verifying 2 datasets ...",
        "note: a dataset was built with --chat-template",
        "setup: verifying 2 datasets: done in 0:01:15",
    ]


def test_a_duration_reads_in_seconds_under_a_minute_and_as_a_clock_from_one():
    assert [progress.duration(s) for s in (0.04, 4.44, 59.9, 59.96, 80.0)] == [
        "0.0 s",
        "4.4 s",
        "59.9 s",
        "0:01:00",
        "0:01:20",
    ]


def test_the_build_line_and_its_summary_give_one_time(smollm2_dir, tmp_path, run_cli):
    """The build's progress line and its summary print the same time: the whole build's, tokenizer load
    included (it printed `build: done in 0:00:00` then `(4.4 s, ...)`)."""
    from dpo_cli.data import main

    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "2 + 2?", "chosen": " 4", "rejected": " 5"}\n')
    result = run_cli(main, "build", rows, "--tokenizer", smollm2_dir, "--out", tmp_path / "out")
    assert result.exit_code == 0, result.stderr
    line = result.stderr.splitlines()[-1]
    assert line.startswith("build ... ") and line.endswith(" s")
    took = line.removeprefix("build ... ")
    assert f"read 1 rows: kept 1 pairs, rejected 0 ({took}, " in result.stdout


def test_a_run_says_each_start_up_stage_with_its_time_and_quiet_silences_them(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    """Before step 1 `dpo-train` says what it does, one timed line per stage of `STAGES`, in their order."""
    from dpo_cli.train import main
    from dpo_train.run.progress import STAGES
    from tests.harness import tiny_config, write_yaml

    config = tiny_config(small_dataset, smollm2_dir, tmp_path / "out", max_steps=1)
    path = write_yaml(tmp_path / "c.yaml", {**config, "eval": {"path": str(small_dataset)}})
    result = run_cli(main, path)
    assert result.exit_code == 0, result.stderr
    lines = [x for x in result.stderr.splitlines() if x.startswith(("setup: ", "step 1: "))]
    said = {key: STAGES[key].format(datasets="2 datasets", step=1) for key in STAGES if key != "resume"}
    assert [x.split(" ... ")[0] for x in lines] == list(said.values())
    assert all(re.fullmatch(r".* \.\.\. \d+\.\d s", x) for x in lines), lines
    assert "attention: segments (auto on the CPU: one sdpa call per segment;" in result.stderr  # the path, and why
    quiet = run_cli(main, path, "--quiet", "--set", f"train.output_dir={tmp_path / 'q'}")
    assert quiet.exit_code == 0 and not [x for x in quiet.stderr.splitlines() if x.startswith(("setup", "step"))]
