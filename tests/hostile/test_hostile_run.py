"""Hostile runs: failing saves, full disks, shared or doomed output_dirs, cut exports, early ends, bad launch flags,
more loader workers than the machine holds."""

from __future__ import annotations

import contextlib
import json
import subprocess
from pathlib import Path

import pytest

from tests.harness import cli_argv, free_port, run_process, state_here, train_cli, train_here
from tests.train.checkpoint.test_checkpoint import config


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
    small_dataset, smollm2_dir, tmp_path, run_cli, monkeypatch
):
    """In-process (the fault is an OSError raised in the commit, no signal nor process is involved)."""
    path, out = config(tmp_path, small_dataset, smollm2_dir, "commit", train__max_steps=2)
    monkeypatch.setenv("DPO_TRAIN_SAVE_FAULT", "commit:2")
    failed = train_here(run_cli, path, code=1)
    assert "saving step 2 failed, nothing was committed" in failed.stderr, failed.stderr
    assert "Traceback" not in failed.stderr
    assert committed(out) == ["step-000001"]
    state_here(run_cli, "verify", out)


@pytest.mark.slow
def test_a_full_disk_during_a_save_is_a_named_error_and_leaves_no_partial_checkpoint(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    # one checkpoint of the tiny model (weights + Adam moments) is about 37 MB: the first fits, the second cannot.
    # In-process: the save joins DCP's writer threads before it returns, so a thread's traceback would be printed
    # while the command's stderr is captured, and seen below
    with small_tmpfs(tmp_path / "disk", 60) as disk:
        path, out = config(disk, small_dataset, smollm2_dir, "full", train__max_steps=3)
        failed = train_here(run_cli, path, code=1)
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
    # released: the run goes ahead, and releases it in turn. In-process, so the release is the run's own doing: a
    # lock this process still held would refuse the next run as another run's (flock locks of two opens conflict)
    train_here(run_cli, path)
    train_here(run_cli, path, "--set", "train.max_steps=2")


def test_an_unwritable_output_dir_is_a_named_error(small_dataset, smollm2_dir, tmp_path, run_cli):
    with small_tmpfs(tmp_path / "ro", 1) as ro:
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        path, _ = config(tmp_path, small_dataset, smollm2_dir, "ro", train__output_dir=str(ro / "run"))
        failed = train_here(run_cli, path, code=1)  # the environment's to fix: exit 1, named
        assert "cannot create the lock file" in failed.stderr and "Traceback" not in failed.stderr


@pytest.fixture
def ctrl_c_heard():
    """SIGINT delivered as a Ctrl-C is, here and in the trainers this test starts: a shell without job control
    starts its background commands with SIGINT ignored (`(pytest &)`), and a child inherits that, so these tests
    would see a run that never hears its Ctrl-C."""
    import signal

    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, before)


@pytest.mark.slow
def test_sigint_names_the_last_committed_checkpoint_and_how_to_resume(
    small_dataset, smollm2_dir, tmp_path, ctrl_c_heard
):
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
@pytest.mark.parametrize(
    ("points", "latest"),
    [
        ("in-save:2:after-dcp", 2),  # held: step 2's save commits, then the run stops naming it
        ("in-save:2:after-dcp,in-save:2:after-rank-files", 1),  # a second Ctrl-C stops at once: step 1 stays
    ],
    ids=["once", "twice"],
)
def test_ctrl_c_during_a_save_lets_it_commit_and_a_second_stops_at_once(
    small_dataset, smollm2_dir, tmp_path, points, latest, ctrl_c_heard
):
    # a real SIGINT to the trainer's process at the named points of step 2's save (DPO_TRAIN_INTERRUPT). Before
    # the hold, one Ctrl-C there lost step 2, and one inside DCP's save was "saving step 2 failed", exit 1
    path, out = config(tmp_path, small_dataset, smollm2_dir, "held", train__max_steps=4)
    stderr = train_cli(path, env={"DPO_TRAIN_INTERRUPT": points}, code=130).stderr
    assert "interrupt: finishing the save of step 2 first (Ctrl-C again stops now)" in stderr
    assert f"the last committed checkpoint is {out / 'checkpoints' / f'step-{latest:06d}'};" in stderr
    assert "failed" not in stderr and "Traceback" not in stderr
    committed = sorted(p.parent.name for p in (out / "checkpoints").glob("*/commit.json"))
    assert committed == [f"step-{k:06d}" for k in range(1, latest + 1)]


def test_a_ctrl_c_that_dcp_wraps_is_an_interrupt_not_a_failed_save(tmp_path, ctrl_c_heard):
    # a second Ctrl-C inside DCP's save: DCP catches it and raises a CheckpointException holding it, which the
    # save used to report as a rank's failure (exit 1, "free disk space"); it is the user's interrupt
    import signal

    import torch
    import torch.distributed.checkpoint as dcp

    from dpo_train.checkpoint.save import _guarded

    class Interrupted(dcp.FileSystemWriter):  # the Ctrl-C lands while DCP writes the tensors
        def write_data(self, plan, planner):
            signal.raise_signal(signal.SIGINT)
            return super().write_data(plan, planner)

    def save():
        dcp.save({"x": torch.zeros(4)}, storage_writer=Interrupted(str(tmp_path / "dcp")), no_dist=True)

    with pytest.raises(dcp.api.CheckpointException) as wrapped:
        save()
    assert any(isinstance(e, KeyboardInterrupt) for e, _ in wrapped.value.failures.values())
    with pytest.raises(KeyboardInterrupt):
        _guarded(0, save)


@pytest.mark.slow
def test_sigkill_during_the_export_leaves_no_final_and_the_rerun_writes_it_whole(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    path, out = config(tmp_path, small_dataset, smollm2_dir, "export", train__max_steps=2, train__save_every=2)
    assert train_cli(path, env={"DPO_TRAIN_KILL": "in-export:final"}, code=None).returncode != 0
    assert not (out / "final").exists() and list(out.glob("final.incomplete-*"))
    report = state_here(run_cli, "report", out, "--json")
    assert json.loads(report.stdout)["summary"]["finished"] is False
    train_here(run_cli, path)  # resumes at step 2 (nothing left to train) and exports again; in-process
    assert (out / "final" / "config.json").stat().st_size > 0 and not list(out.glob("final.*"))


@pytest.mark.slow
def test_max_steps_wins_over_epochs_and_says_so_and_null_trains_the_epochs(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    # 24 pairs, 12 per step: an epoch is 2 steps, so 3 steps go on into epoch 2. Both runs in-process: what is read
    # is their note and their log
    short = ("--set", "train.save_every=0", "--set", "data.pairs_per_step=12")
    path, out = config(tmp_path, small_dataset, smollm2_dir, "steps", train__max_steps=3, train__epochs=1)
    ran = train_here(run_cli, path, *short)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3
    assert "note: train.max_steps 3 goes on into epoch 2 of the data, past train.epochs 1" in ran.stderr
    path, out = config(tmp_path, small_dataset, smollm2_dir, "epochs", train__max_steps=None, train__epochs=2)
    ran = train_here(run_cli, path, *short)
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 4 and "note:" not in ran.stderr


@pytest.mark.slow
def test_weights_from_a_lora_checkpoint_names_what_it_is_and_what_to_do(small_dataset, smollm2_dir, tmp_path, run_cli):
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    path, out = config(tmp_path, small_dataset, smollm2_dir, "lora", train__max_steps=1, model__lora=lora)
    train_here(run_cli, path)  # in-process: the run only makes the checkpoint the refusal reads
    path, _ = config(tmp_path, small_dataset, smollm2_dir, "new", train__max_steps=1, train__weights_from=str(out))
    stderr = refused(run_cli, path)
    assert "is a LoRA run's checkpoint" in stderr and "resume that run instead" in stderr
    assert "damaged or was replaced" not in stderr


# -- launch flags: refused by name before torchrun starts, never its traceback nor a wait ----------------------

LAUNCH_TIMEOUT_S = 60
"""A launch refusal takes a fraction of a second; one still going after this has gone on to torchrun and waits."""


def launch_refused(tmp_path, *flags, code: int = 2) -> str:
    """`dpo-train CONFIG FLAGS` as a user's shell runs it: exit `code` before anything starts (a hang is killed and
    fails), one `error:` line, no traceback. Its stderr."""
    proc = run_process(cli_argv("train", tmp_path / "train.yaml", *flags), code=code, timeout=LAUNCH_TIMEOUT_S)
    assert "Traceback" not in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith("error: --"), proc.stderr
    return proc.stderr


@pytest.mark.parametrize(
    "flags, named",
    [
        (["--rdzv-endpoint", "127.0.0.1:99999"], "--rdzv-endpoint is '127.0.0.1:99999' (the port '99999' is not"),
        (["--rdzv-endpoint", ":::"], "--rdzv-endpoint is ':::' (no port)"),
        (["--rdzv-endpoint", "h:1 --foo"], "--rdzv-endpoint is 'h:1 --foo' (the port '1 --foo' is not a number"),
        (["--rdzv-endpoint", "127.0.0.1"], "--rdzv-endpoint is '127.0.0.1' (no port)"),  # waited, before
        (["--rdzv-endpoint=-node0:29500"], "the host '-node0' is not a hostname"),
        (["--rdzv-endpoint", "::1:29500"], "an IPv6 address goes in brackets, e.g. [::1]:29500"),
        (["--rdzv-endpoint", "127.0.0.1:29500", "--rdzv-backend", "nope"], "--rdzv-backend is 'nope'; allowed: c10d"),
        (["--rdzv-endpoint", "127.0.0.1:29500", "--rdzv-id", "a b"], "--rdzv-id is 'a b'; allowed: 1 to 128"),
        (
            ["--nnodes", "99999999999999999999"],
            "--nnodes is 99999999999999999999; allowed: 1 or more machines, at most 100000",
        ),
        (["--nproc-per-node", "0"], "--nproc-per-node is 0; allowed: 1 to 1024"),
        (["--nproc-per-node", "99999"], "--nproc-per-node is 99999; allowed: 1 to 1024"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_a_bad_launch_flag_is_one_named_line_before_torchrun_starts(flags, named, tmp_path):
    """Before: torchrun's traceback (exit 1) for a bad port, host or backend, and a silent wait for a missing port
    or 10**20 nodes. Each flag also comes with --nnodes 2 (without an endpoint: the old code refused that first)."""
    nodes = [] if "--nnodes" in flags else ["--nnodes", "2"]
    if "--nnodes" in flags:
        flags = [*flags, "--rdzv-endpoint", f"127.0.0.1:{free_port()}"]
    assert named in launch_refused(tmp_path, *nodes, *flags)


@pytest.mark.parametrize("endpoint", ["node0:29500", "10.0.0.1:1", "[::1]:29500", "[fe80::1%eth0]:65535", "a.b_c-d:80"])
def test_the_endpoints_torchrun_reads_are_taken(endpoint):
    from dpo_cli.train import _endpoint_problem

    assert _endpoint_problem(endpoint) is None


def test_a_failed_rendezvous_is_one_line_exit_1(monkeypatch, capsys):
    """A node that never joins: torchrun raises a RendezvousTimeoutError (after its join timeout), here at once."""
    import torch.distributed.run
    from torch.distributed.elastic.rendezvous.api import RendezvousTimeoutError

    from dpo_cli import launch

    def no_peers(argv):
        raise RendezvousTimeoutError("the rendezvous timed out") from TimeoutError("waited 600 s\n  frame #0: ...")

    monkeypatch.setattr(torch.distributed.run, "main", no_peers)
    with pytest.raises(SystemExit) as exited:
        launch.main()
    stderr = capsys.readouterr().err
    assert exited.value.code == 1 and len(stderr.strip().splitlines()) == 1
    said = "error: the rendezvous failed: RendezvousTimeoutError: the rendezvous timed out (TimeoutError: waited 600 s)"
    assert stderr.startswith(said) and "--rdzv-endpoint" in stderr


# -- data.num_workers: no more loader workers than the machine holds -------------------------------------------


@pytest.fixture
def machine(monkeypatch):
    """Set what the worker bound reads of this machine: machine(cpus, available GiB, processes)."""
    from dpo_data.loading import config as loading

    def set_to(cpus: int, gib: float | None, processes: int = 1) -> None:
        facts = loading.Machine(cpus, None if gib is None else int(gib * 2**30), processes)
        monkeypatch.setattr(loading, "machine", lambda: facts)

    return set_to


@pytest.mark.parametrize(
    "facts, most, why",
    [
        ((1024, 4096.0), 64, "at most 64 on any machine"),
        ((2, 4096.0), 8, "4 per CPU of 2, for one training process"),
        (
            (64, 2.0, 2),
            2,
            "256 MB each within 50% of the 2.0 GiB of memory available now, shared by 2 training processes",
        ),
        ((1024, None, 4), 64, "at most 64 on any machine"),  # memory unknown: the other bounds
    ],
)
def test_loader_workers_are_bounded_by_a_fixed_cap_the_cpus_and_the_memory(facts, most, why, machine):
    """Before: up to 1,024 workers per rank were taken; dozens took 13 of this machine's 23 GB."""
    from dpo_data import DataError, LoaderConfig

    machine(*facts)
    assert LoaderConfig(num_workers=most).num_workers == most
    with pytest.raises(DataError) as refused:
        LoaderConfig(num_workers=most + 1)
    assert str(refused.value) == (
        f"num_workers (data.num_workers) is {most + 1}; allowed: 0 to {most} loader workers per rank here ({why}). "
        f"Fix: set it to {most} or less (0 loads in the training process itself)"
    )


def test_the_machine_facts_count_the_training_processes_sharing_it(monkeypatch):
    from dpo_data.loading.config import machine

    monkeypatch.setenv("LOCAL_WORLD_SIZE", "3")
    here = machine()
    assert here.processes == 3 and here.cpus >= 1 and (here.available_bytes is None or here.available_bytes > 0)


def test_a_run_with_more_workers_than_the_memory_holds_is_refused_before_any_starts(
    small_dataset, smollm2_dir, tmp_path, run_cli, machine
):
    machine(64, 1.0)  # half of 1 GiB holds 2 workers of 256 MB
    path, out = config(tmp_path, small_dataset, smollm2_dir, "workers", train__max_steps=1, data__num_workers=8)
    stderr = refused(run_cli, path)
    assert "num_workers (data.num_workers) is 8; allowed: 0 to 2 loader workers per rank here" in stderr
    assert not (out / "metrics.jsonl").exists()
