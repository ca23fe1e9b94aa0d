"""The test harness keeps its promises: hung spawns and processes fail the test, a wrong exit shows the stderr tail."""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from tests.harness import STDERR_TAIL, data_cli, run_process, spawn, state_cli, state_here, train_cli, train_here


def _hangs(rank: int, world: int, port: int) -> None:
    time.sleep(120)


def _raises(rank: int, world: int, port: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 failed on purpose")


def test_a_hung_spawn_fails_the_test_within_its_timeout():
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"2 spawned ranks of _hangs did not finish within 3 s"):
        spawn(_hangs, 2, timeout_s=3)
    assert time.monotonic() - start < 60  # the hung ranks were killed, not waited for


def test_a_failing_rank_fails_the_test_with_its_error():
    with pytest.raises(Exception, match="rank 1 failed on purpose"):
        spawn(_raises, 2)


def test_an_unexpected_exit_code_fails_the_test_showing_the_stderr_tail():
    script = "import sys; sys.stderr.write('early' + 'x' * 5000 + 'the error, last'); sys.exit(3)"
    with pytest.raises(pytest.fail.Exception) as info:
        run_process([sys.executable, "-c", script])
    head, tail = str(info.value).split("\n", 1)
    assert head == f"python -c {script} exited 3, expected 0; its stderr ends:"
    assert tail == "x" * (STDERR_TAIL - len("the error, last")) + "the error, last"  # the end, not 'early'
    assert run_process([sys.executable, "-c", script], code=3).returncode == 3
    assert run_process([sys.executable, "-c", script], code=None).stderr.startswith("early")


def test_a_hung_process_is_killed_with_what_it_started_and_fails_the_test(tmp_path):
    """The child starts a grandchild (as dpo-train starts torchrun's ranks); both hang, both are killed."""
    pid_file = tmp_path / "grandchild.pid"
    script = (
        "import subprocess, sys, time; "
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
        f"open({str(pid_file)!r}, 'w').write(str(p.pid)); sys.stderr.write('waiting'); sys.stderr.flush(); "
        "time.sleep(120)"
    )
    start = time.monotonic()
    with pytest.raises(pytest.fail.Exception, match=r"did not finish within 3 s \(killed\); its stderr ends:\nwaiting"):
        run_process([sys.executable, "-c", script], timeout=3)
    assert time.monotonic() - start < 60
    grandchild = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while _alive(grandchild) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _alive(grandchild)


def _alive(pid: int) -> bool:
    """Running, not gone nor a zombie waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_env_is_added_to_this_environment_and_cwd_is_where_it_runs(tmp_path):
    script = "import os; print(os.environ['DPO_HARNESS_CHECK'], os.environ['PATH'] == {!r}, os.getcwd())"
    argv = [sys.executable, "-c", script.format(os.environ["PATH"])]
    proc = run_process(argv, env={"DPO_HARNESS_CHECK": "1"}, cwd=tmp_path)
    assert proc.stdout.split() == ["1", "True", str(tmp_path)]


def test_each_runner_runs_its_real_entry_point():
    assert train_cli("--help").stdout.startswith("Usage: python -m dpo_cli.train [OPTIONS] [CONFIG]")
    assert data_cli("--help").stdout.startswith("Usage: python -m dpo_cli.data [OPTIONS] COMMAND")
    assert state_cli("--help").stdout.startswith("Usage: python -m dpo_cli.state [OPTIONS] COMMAND")


def test_an_in_process_run_that_exits_otherwise_fails_the_test_showing_its_stderr(tmp_path, run_cli):
    missing = tmp_path / "nowhere.yaml"
    with pytest.raises(pytest.fail.Exception) as info:
        train_here(run_cli, missing)
    assert str(info.value) == (
        f"dpo-train {missing} --quiet (in-process) exited 2, expected 0; its stderr ends:\n"
        f"error: config file {missing} does not exist; pass a YAML file\n"
    )
    assert train_here(run_cli, missing, code=2).exit_code == 2
    assert "holds no committed checkpoint" in state_here(run_cli, "verify", tmp_path, code=1).stderr


def test_every_file_dealt_out_first_exists():
    """A file of tests/conftest.py's HEAVIEST_FIRST renamed or moved would silently go back to its collected
    place (and the suite's long files to its end)."""
    from tests.conftest import HEAVIEST_FIRST

    root = Path(__file__).resolve().parents[1]
    assert [name for name in HEAVIEST_FIRST if not (root / name).is_file()] == []
