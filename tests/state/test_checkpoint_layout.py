"""Where checkpoints live (dpo_state/layout.py): moving committed checkpoints aside keeps every one of them."""

from __future__ import annotations

import time

from dpo_state.layout import move_aside, step_dir


def _checkpoint(run, step: int, marker: str):
    path = step_dir(run, step)
    path.mkdir(parents=True)
    (path / "commit.json").write_text(marker)
    return path


def test_two_moves_within_one_second_keep_both_checkpoints(tmp_path, monkeypatch):
    """Two resumes from one step within a second each move a step-2 aside under one reason: the second move
    gets a directory of its own (before: the same name, and the rename failed on the first's step-2)."""
    monkeypatch.setattr(time, "strftime", lambda *_: "20261206T120000")
    first = move_aside(tmp_path, [_checkpoint(tmp_path, 2, "first")], "after-resume-from-step-000001")
    second = move_aside(tmp_path, [_checkpoint(tmp_path, 2, "second")], "after-resume-from-step-000001")
    assert first.name == "20261206T120000-after-resume-from-step-000001"
    assert second.name == f"{first.name}-2" and second.parent == first.parent
    assert (first / "step-000002" / "commit.json").read_text() == "first"
    assert (second / "step-000002" / "commit.json").read_text() == "second"
    assert not step_dir(tmp_path, 2).exists()


def test_nothing_to_move_makes_no_directory(tmp_path):
    assert move_aside(tmp_path, [], "why") is None
    assert not (tmp_path / "checkpoints").exists()
