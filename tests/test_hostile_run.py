"""A careless or hostile user against a run directory: failing saves (a full disk included), two runs into
one directory, an output_dir a rebuild would delete, an export cut off, settings that end a run early."""

from __future__ import annotations

import contextlib
import subprocess
from pathlib import Path

import pytest

from tests.test_checkpoint import config, state_cli, train


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
def test_a_failing_commit_removes_its_directory_and_keeps_the_previous_checkpoint(small_dataset, smollm2_dir, tmp_path):
    path, out = config(tmp_path, small_dataset, smollm2_dir, "commit", train__max_steps=2)
    failed = train(path, env={"DPO_TRAIN_SAVE_FAULT": "commit:2"}, check=1)
    assert "saving step 2 failed, nothing was committed" in failed.stderr, failed.stderr
    assert "Traceback" not in failed.stderr
    assert committed(out) == ["step-000001"]
    assert state_cli("verify", out).returncode == 0


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_a_named_error_and_leaves_no_partial_checkpoint(
    small_dataset, smollm2_dir, tmp_path
):
    # one checkpoint of the tiny model (weights + Adam moments) is about 37 MB: the first fits, the second cannot
    with small_tmpfs(tmp_path / "disk", 60) as disk:
        path, out = config(disk, small_dataset, smollm2_dir, "full", train__max_steps=3)
        failed = train(path, check=1)
        assert "saving step 2 failed, nothing was committed" in failed.stderr, failed.stderr[-3000:]
        assert "OSError: [Errno 28] No space left on device" in failed.stderr
        assert "Traceback" not in failed.stderr and "Exception in thread" not in failed.stderr
        assert committed(out) == ["step-000001"]
        assert state_cli("verify", out).returncode == 0
