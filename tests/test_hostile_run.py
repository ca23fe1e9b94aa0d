"""Hostile run directories: failing saves, full disks, shared or doomed output_dirs, cut exports, early ends."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

import pytest

from tests.harness import cli_argv, state_here, train_cli, train_here
from tests.test_checkpoint import config


def committed(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))


@contextlib.contextmanager
def small_tmpfs(where: Path, megabytes: int):
    """A tmpfs of `megabytes` at `where`, or a skip where this machine does not allow mounting (not root)."""
    where.mkdir(parents=True)
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={megabytes}m", "tmpfs", str(where)], check=False)
    if mounted.returncode:
        pytest.skip("mounting a tmpfs needs root; the full-disk case is not run here")
    try:
        yield where
    finally:
        subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.slow
def test_a_failing_commit_removes_its_directory_and_keeps_the_previous_checkpoint(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    path, out = config(tmp_path, small_dataset, smollm2_dir, "commit", train__max_steps=2)
    failed = train_cli(path, env={"DPO_TRAIN_SAVE_FAULT": "commit:2"}, code=1)
    assert "saving step 2 failed, nothing was committed" in failed.stderr, failed.stderr
    assert "Traceback" not in failed.stderr
    assert committed(out) == ["step-000001"]
    state_here(run_cli, "verify", out)


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_a_named_error_and_leaves_no_partial_checkpoint(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    # one checkpoint of the tiny model (weights + Adam moments) is about 37 MB: the first fits, the second cannot
    with small_tmpfs(tmp_path / "disk", 60) as disk:
        path, out = config(disk, small_dataset, smollm2_dir, "full", train__max_steps=3)
        failed = train_cli(path, code=1)
        assert "saving step 2 failed, nothing was committed" in failed.stderr, failed.stderr[-3000:]
        assert "OSError: [Errno 28] No space left on device" in failed.stderr
        assert "Traceback" not in failed.stderr and "Exception in thread" not in failed.stderr
        assert committed(out) == ["step-000001"]
        state_here(run_cli, "verify", out)


def refused(run_cli, path, *extra) -> str:
    """dpo-train's refusal of the config at `path` (exit 2, no traceback), in-process: its stderr."""
    proc = train_here(run_cli, path, *extra, code=2)
    assert "Traceback" not in proc.stderr
    return proc.stderr


@pytest.mark.parametrize("where", ["the dataset", "inside the dataset", "holding the dataset", "an unnamed dataset"])
def test_an_output_dir_a_rebuild_would_delete_or_that_holds_a_dataset_is_refused(
    where, small_dataset, smollm2_dir, tmp_path, run_cli
):
    over = {"the dataset": small_dataset, "inside the dataset": small_dataset / "run"}
    if where == "holding the dataset":
        over[where] = small_dataset.parent
    if where == "an unnamed dataset":  # any directory holding a dataset's manifest and shards
        (tmp_path / "other" / "shards").mkdir(parents=True)
        (tmp_path / "other" / "manifest.json").write_text("{}")
        over[where] = tmp_path / "other" / "runs" / "x"
    path, out = config(tmp_path, small_dataset, smollm2_dir, "run", train__output_dir=str(over[where]))
    stderr = refused(run_cli, path)
    assert "train.output_dir" in stderr and ("lies inside the dataset" in stderr or "holds the dataset" in stderr)
    assert not (Path(over[where]) / "config.resolved.yaml").exists()


def test_the_filesystem_root_or_a_system_directory_is_refused_before_anything_is_written(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    existed = Path("/config.resolved.yaml").exists()
    try:
        for where, says in (("/", "a run needs a directory of its own"), ("/usr/lib/run", "system directory /usr")):
            path, _ = config(tmp_path, small_dataset, smollm2_dir, "root", train__output_dir=where)
            assert says in refused(run_cli, path)
        assert existed or not Path("/config.resolved.yaml").exists()
    finally:
        if not existed:  # the old code wrote it there
            Path("/config.resolved.yaml").unlink(missing_ok=True)


def test_a_second_run_into_a_run_directory_in_use_is_refused_naming_the_holder(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    import fcntl
    import os

    path, out = config(tmp_path, small_dataset, smollm2_dir, "busy", train__max_steps=1, train__save_every=0)
    lock = Path(f"{out}.lock")
    with open(lock, "w") as held:  # another process holds the run directory, as a running training does
        fcntl.flock(held, fcntl.LOCK_EX)
        held.write(f"pid {os.getpid()} on this host, since now\n")
        held.flush()
        stderr = refused(run_cli, path)
        assert f"is in use by another run (pid {os.getpid()} on this host" in stderr
    train_cli(path)  # released: the run goes ahead, and releases it in turn
    train_cli(path, "--set", "train.max_steps=2")


def test_an_unwritable_output_dir_is_a_named_error(small_dataset, smollm2_dir, tmp_path, run_cli):
    with small_tmpfs(tmp_path / "ro", 1) as ro:
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        path, _ = config(tmp_path, small_dataset, smollm2_dir, "ro", train__output_dir=str(ro / "run"))
        failed = train_here(run_cli, path, code=1)  # the environment's to fix: exit 1, named
        assert "cannot create the lock file" in failed.stderr and "Traceback" not in failed.stderr


@pytest.mark.slow
def test_sigint_names_the_last_committed_checkpoint_and_how_to_resume(small_dataset, smollm2_dir, tmp_path):
    import signal
    import time

    path, out = config(tmp_path, small_dataset, smollm2_dir, "int", train__max_steps=400, train__epochs=100)
    proc = subprocess.Popen(cli_argv("train", path, "--quiet"), stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not list((out / "checkpoints").glob("*/commit.json")):
        assert proc.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    proc.send_signal(signal.SIGINT)
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode == 130, stderr[-3000:]
    assert "interrupted: the last committed checkpoint is" in stderr and "rerun the same command to resume" in stderr
    assert "Aborted!" not in stderr and "Traceback" not in stderr


@pytest.mark.slow
def test_sigkill_during_the_export_leaves_no_final_and_the_rerun_writes_it_whole(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    path, out = config(tmp_path, small_dataset, smollm2_dir, "export", train__max_steps=2, train__save_every=2)
    assert train_cli(path, env={"DPO_TRAIN_KILL": "in-export:final"}, code=None).returncode != 0
    assert not (out / "final").exists() and list(out.glob("final.incomplete-*"))
    report = state_here(run_cli, "report", out, "--json")
    assert json.loads(report.stdout)["summary"]["finished"] is False
    train_cli(path)  # resumes at step 2 (nothing left to train) and exports again
    assert (out / "final" / "config.json").stat().st_size > 0 and not list(out.glob("final.*"))


@pytest.mark.slow
def test_max_steps_wins_over_epochs_and_says_so_and_null_trains_the_epochs(small_dataset, smollm2_dir, tmp_path):
    # 24 pairs, 12 per step: an epoch is 2 steps
    short = ("--set", "train.save_every=0", "--set", "data.pairs_per_step=12")
    path, out = config(tmp_path, small_dataset, smollm2_dir, "steps", train__max_steps=4, train__epochs=1)
    ran = train_cli(path, *short)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4
    assert "note: train.max_steps 4 goes on into epoch 2 of the data, past train.epochs 1" in ran.stderr
    path, out = config(tmp_path, small_dataset, smollm2_dir, "epochs", train__max_steps=None, train__epochs=2)
    ran = train_cli(path, *short)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4 and "note:" not in ran.stderr


@pytest.mark.slow
def test_weights_from_a_lora_checkpoint_names_what_it_is_and_what_to_do(small_dataset, smollm2_dir, tmp_path, run_cli):
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    path, out = config(tmp_path, small_dataset, smollm2_dir, "lora", train__max_steps=1, model__lora=lora)
    train_cli(path)
    path, _ = config(tmp_path, small_dataset, smollm2_dir, "new", train__max_steps=1, train__weights_from=str(out))
    stderr = refused(run_cli, path)
    assert "is a LoRA run's checkpoint" in stderr and "resume that run instead" in stderr
    assert "damaged or was replaced" not in stderr
