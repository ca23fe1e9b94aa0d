"""Hostile disks (issue 55): a full or read-only disk under a build, a save or an export is one named error line and
exit 1, never a traceback; nothing half-written is left in place of a good dataset, checkpoint or export, and the
trained steps are kept. The disks are real: a small tmpfs (full), remounted read-only (this needs root, as CI's
container has; without it a full disk is a per-file size limit, RLIMIT_FSIZE, and a read-only one is skipped)."""

from __future__ import annotations

import contextlib
import json
import os
import resource
import signal
import subprocess
import time
from pathlib import Path

import pytest

from tests.conftest import chat, write_jsonl
from tests.harness import cli_argv, data_here, run_process, state_here, tiny_config, train_cli, train_here, write_yaml

FEW = [chat(f"What is {i} + {i}?", f"It is {2 * i}.", f"It is {2 * i + 1}.") for i in range(3)]
MANY = [chat(f"What is {i} + {i}? " * 20, f"It is {2 * i}.", f"It is {2 * i + 1}.") for i in range(200)]
"""A dataset of about 200 KB: more than the disks below hold, where FEW's (about 12 KB) fits."""
LORA = {"r": 2, "alpha": 4, "target_modules": ["q_proj"]}


@contextlib.contextmanager
def tmpfs(where: Path, size: str):
    """A tmpfs of `size` (mount's words: 128k, 4m) at `where`; yields whether it mounted (as root), unmounted after."""
    where.mkdir(parents=True, exist_ok=True)
    mounted = _mount("-t", "tmpfs", "-o", f"size={size}", "tmpfs", where)
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(where)], check=False)


def _mount(*args) -> bool:
    return subprocess.run(["mount", *map(str, args)], capture_output=True, check=False).returncode == 0


def _limited(argv: list, limit: int | None, code: int) -> subprocess.CompletedProcess:
    """`argv` run as `run_process` runs it; with `limit`, every file it writes stops at `limit` bytes (EFBIG, an
    OSError: SIGXFSZ ignored), the full disk of a machine where mounting a tmpfs is not allowed."""
    if limit is None:
        return run_process(argv, code=code)

    def cap() -> None:
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    proc = subprocess.run([str(a) for a in argv], capture_output=True, text=True, timeout=600, preexec_fn=cap)
    assert proc.returncode == code, proc.stderr[-4000:]
    return proc


def _one_error(stderr: str) -> str:
    """The run's one `error:` line (nothing else it printed is an error, and no traceback)."""
    assert "Traceback" not in stderr and "Exception in thread" not in stderr, stderr[-4000:]
    (line,) = [line for line in stderr.splitlines() if line.startswith("error:")]
    return line


def _build_argv(rows: Path, tokenizer: Path, out: Path, *more) -> list:
    return cli_argv("data", "build", rows, "--tokenizer", tokenizer, "--out", out, *more)


def _pairs(dataset: Path) -> int:
    return json.loads((dataset / "manifest.json").read_text())["totals"]["pairs"]


def test_a_build_that_fills_the_disk_is_one_error_line_and_keeps_the_dataset_it_would_replace(
    smollm2_dir, tmp_path, run_cli
):
    """Before: pyarrow's OSError (errno 28) ended `dpo-data build` in a traceback."""
    few, many = write_jsonl(tmp_path / "few.jsonl", FEW), write_jsonl(tmp_path / "many.jsonl", MANY)
    disk = tmp_path / "disk"
    with tmpfs(disk, "128k") as mounted:
        limit = None if mounted else 64 << 10
        out = disk / "ds"
        data_here(run_cli, "build", few, "--tokenizer", smollm2_dir, "--out", out)
        failed = _limited(_build_argv(many, smollm2_dir, out, "--overwrite"), limit, code=1)
        line = _one_error(failed.stderr)
        reason = "No space left on device" if mounted else "File too large"
        fix = f"free space on the filesystem holding {disk}" if mounted else "raise the file size limit"
        assert line.startswith(f"error: --out {out}: the build could not be written ({reason}"), line
        assert f"nothing was committed; {out} is unchanged. Fix: {fix}" in line and "or choose another --out" in line
        assert not list(disk.glob("ds.incomplete-*"))
        data_here(run_cli, "verify", out)
        assert _pairs(out) == 3


def test_a_build_onto_a_disk_already_full_is_one_error_line_naming_the_lock(smollm2_dir, tmp_path, run_cli):
    """Before: the lock file was created (an inode) but its holder's line did not fit: an OSError traceback."""
    few = write_jsonl(tmp_path / "few.jsonl", FEW)
    disk = tmp_path / "disk"
    with tmpfs(disk, "4k") as mounted:
        if not mounted:
            pytest.skip("mounting a tmpfs needs root (mount); this full disk is not run here")
        (disk / "filler").write_bytes(bytes(4096))
        out = disk / "ds"
        failed = data_here(run_cli, "build", few, "--tokenizer", smollm2_dir, "--out", out, code=2)
        assert _one_error(failed.stderr) == (
            f"error: --out {out}: cannot create the lock file {disk / 'ds.lock'} (No space left on device); choose "
            "a writable location"
        )
        assert not out.exists()


@pytest.mark.parametrize("earlier", [False, True], ids=["new", "replacing"])
def test_a_build_whose_disk_turns_read_only_is_one_error_line_and_keeps_the_dataset_it_would_replace(
    smollm2_dir, tmp_path, run_cli, earlier
):
    """Before: the rename into place raised OSError (errno 30), a traceback; the swap with an earlier dataset was
    a usage error (exit 2). The disk is remounted read-only while the build is stopped just before its swap
    (`DPO_DATA_STOP=before-swap`): Linux refuses to remount a filesystem read-only while a file on it is open for
    writing (a disk that fails goes read-only regardless), and this is the moment a build holds none open; the lock
    file, open for the whole build, is a link to another filesystem for the same reason. The staging directory the
    read-only disk keeps is named, and the next build removes it."""
    few, many = write_jsonl(tmp_path / "few.jsonl", FEW), write_jsonl(tmp_path / "many.jsonl", MANY)
    disk = tmp_path / "disk"
    with tmpfs(disk, "1m") as mounted:
        if not mounted:
            pytest.skip("remounting a disk read-only needs root (mount); the read-only case is not run here")
        out = disk / "ds"
        (tmp_path / "ds.lock").touch()
        (disk / "ds.lock").symlink_to(tmp_path / "ds.lock")
        if earlier:
            data_here(run_cli, "build", few, "--tokenizer", smollm2_dir, "--out", out)
        stderr = _stopped_then(
            _build_argv(many, smollm2_dir, out, "--overwrite"), {"DPO_DATA_STOP": "before-swap"}, disk, "remount,ro"
        )
        line = _one_error(stderr)
        (left,) = disk.glob("ds.incomplete-*")
        kept = f"; {out} is unchanged" if earlier else ""
        assert line.startswith(f"error: --out {out}: the build could not be moved into place (Read-only file system")
        assert f"nothing was committed{kept}; {left} is left (the next build of --out that commits" in line, line
        assert f"Fix: make the filesystem holding {disk} writable again" in line
        if earlier:
            data_here(run_cli, "verify", out)
            assert _pairs(out) == 3
        else:
            assert not out.exists()
        assert _mount("-o", "remount,rw", disk)
        data_here(run_cli, "build", many, "--tokenizer", smollm2_dir, "--out", out, "--overwrite")
        assert _pairs(out) == 200 and not left.exists()


def _stopped_then(argv: list, env: dict, disk: Path, options: str) -> str:
    """Run `argv` until it stops itself (SIGSTOP at a fault point), remount `disk` with `options`, let it go on;
    its stderr once it exits 1."""
    with subprocess.Popen(
        [str(a) for a in argv], stderr=subprocess.PIPE, text=True, env={**os.environ, **env}, start_new_session=True
    ) as proc:
        try:
            _wait_stopped(proc.pid)
            assert _mount("-o", options, disk), f"mount -o {options} {disk} failed"
        finally:
            proc.send_signal(signal.SIGCONT)
        stderr = proc.communicate(timeout=120)[1]
    assert proc.returncode == 1, stderr[-4000:]
    return stderr


def _wait_stopped(pid: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        if state == "T":
            return
        assert state != "Z", "the build exited before its fault point"
        time.sleep(0.05)
    pytest.fail(f"the build did not reach its fault point within {timeout} s")


@pytest.mark.slow
def test_a_save_onto_a_disk_turned_read_only_is_one_error_line_and_keeps_the_last_checkpoint(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    """Before: creating step-000002 raised OSError (errno 30) outside the save's failure handling, a traceback (with
    more ranks, rank 0 alone died). The checkpoints' disk is remounted read-only between a run and its resume."""
    out = tmp_path / "run"
    checkpoints = out / "checkpoints"
    with tmpfs(checkpoints, "64m") as mounted:
        if not mounted:
            pytest.skip("remounting a disk read-only needs root (mount); the read-only case is not run here")
        path = write_yaml(
            tmp_path / "run.yaml", tiny_config(small_dataset, smollm2_dir, out, max_steps=1, save_every=1)
        )
        train_here(run_cli, path)
        assert _mount("-o", "remount,ro", checkpoints)
        failed = train_cli(path, "--set", "train.max_steps=2", code=1)
        line = _one_error(failed.stderr)
        assert line.startswith("error: saving step 2 failed, nothing was committed"), line
        assert f"Read-only file system: '{checkpoints / 'step-000002'}'" in line
        assert f"Fix: make the filesystem holding {checkpoints} writable again" in line
        assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000001"]
        state_here(run_cli, "verify", checkpoints / "step-000001")


@pytest.mark.slow
def test_an_export_that_fills_the_disk_keeps_the_trained_steps_in_a_checkpoint_and_the_rerun_exports(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    """Before: safetensors' SafetensorError (os error 28) ended the run in a traceback, left final.incomplete-*, and
    with `save_every: 0` the trained steps were lost. LoRA with `train.export: merged` separates the two writes for
    real: the checkpoint holds the adapters and their optimizer state (KBs), the merged export the whole model
    (12 MB), so a 4 MB disk takes the one and not the other."""
    disk = tmp_path / "disk"
    out = disk / "run"
    config = tiny_config(small_dataset, smollm2_dir, out, max_steps=2, save_every=0, export="merged")
    config["model"]["lora"] = LORA
    path = write_yaml(tmp_path / "run.yaml", config)
    with tmpfs(disk, "4m") as mounted:
        limit = None if mounted else 1 << 20
        failed = _limited(cli_argv("train", path, "--quiet"), limit, code=1)
        line = _one_error(failed.stderr)
        kept = out / "checkpoints" / "step-000002"
        reason = "No space left on device" if mounted else "File too large"
        assert line.startswith(f"error: final/ was not written: {reason}, writing {out}/final.incomplete-"), line
        assert "nothing half-written is left" in line
        assert (
            f"The trained weights of step 2 are in the committed checkpoint {kept}; rerunning the same command "
            "after the fix resumes from it and exports again" in line
        )
        assert not (out / "final").exists() and not list(out.glob("final.incomplete-*"))
        state_here(run_cli, "verify", kept)
        assert not mounted or _mount("-o", "remount,size=64m", disk)
        rerun = train_here(run_cli, path)
        assert f"resumed from {kept} at step 2" in rerun.stderr
        state_here(run_cli, "verify", out / "final")


@pytest.mark.slow
def test_a_full_disk_where_no_code_names_it_is_still_one_error_line_and_no_half_written_file(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    """Before: the reference sidecar's write onto a full disk (a 4 KB tmpfs: its table fits, not reference.json)
    was an OSError with the trainer's traceback, and left .reference.json.tmp beside the table. The one-line error
    is the CLI's net for any disk fault (`dpo_state.disk`); the sidecar is absent without its reference.json."""
    disk = tmp_path / "disk"
    config = tiny_config(small_dataset, smollm2_dir, tmp_path / "run", max_steps=1)
    config["reference"] = {"mode": "precomputed", "path": str(disk / "ref")}
    path = write_yaml(tmp_path / "run.yaml", config)
    with tmpfs(disk, "4k") as mounted:
        if not mounted:
            pytest.skip("mounting a tmpfs needs root (mount); this full disk is not run here")
        failed = train_here(run_cli, path, "--precompute-reference", code=1)
        line = _one_error(failed.stderr)
        assert line == (
            f"error: No space left on device: {disk / 'ref' / 'reference.json'} (OSError). Fix: free space on the "
            f"filesystem holding {disk / 'ref'}"
        ), line
        assert not list((disk / "ref").glob(".*.tmp"))
