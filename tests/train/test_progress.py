"""Long stages say what they do in a log: a start line, timed lines (count, elapsed, ETA), a done line."""

from __future__ import annotations

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
