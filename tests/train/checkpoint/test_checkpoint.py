"""Checkpoints end to end through the real CLI: exact resume after a real SIGKILL, crash safety during saves,
fail-closed identity checks, retention, and a failing save on one rank committing nothing. Every killed run is a
launched `dpo-train`; a run that is not killed and whose process is not what is checked (the uninterrupted
references, a last resume of one process, the elastic resume) runs dpo-train's code in this process or in
spawned ranks, without an interpreter start and torch's import each."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from dpo_state.commit import write_commit
from dpo_state.installed import environment
from tests.harness import TINY_LLAMA, invoke, rank_worker, spawn, state_here, train_here

MODEL = TINY_LLAMA
TIMING = ("pairs/s", "tokens/s", "time")


def config(tmp_path, dataset, tokenizer, name, **over) -> tuple:
    out = tmp_path / name
    c = {
        "model": {"init": {"config": MODEL, "seed": 0}, "tokenizer": str(tokenizer)},
        "data": {"path": str(dataset), "batching": "pairs", "pairs_per_step": 4, "max_tokens_per_microbatch": 256},
        "optim": {"lr": 1.0e-3, "scheduler": "cosine", "warmup_steps": 2},
        "train": {"output_dir": str(out), "max_steps": 8, "epochs": 3, "save_every": 1, "keep_last": 2},
        "distributed": {"strategy": "fsdp"},
    }
    for key, value in over.items():
        section, name_ = key.split("__")
        c.setdefault(section, {})[name_] = value
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(c))
    return path, out


def train(path, *extra, nproc=1, env=None, check=0):
    args = [sys.executable, "-m", "dpo_cli.train", str(path), "--quiet", *extra]
    if nproc > 1:
        args += ["--nproc-per-node", str(nproc)]
    proc = subprocess.run(
        args, capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})}, start_new_session=True
    )
    if check is not None:
        assert proc.returncode == check, proc.stderr[-4000:]
    return proc


def metrics(out):
    return [
        {k: v for k, v in json.loads(x).items() if k not in TIMING}
        for x in (out / "metrics.jsonl").read_text().splitlines()
    ]


CASES = [  # (kills, world, workers, batching): each kill lands right after committing that step, and the next
    # attempt resumes from it. Two runs cover every dimension (world 1 and 2, 0 and 2 loader workers, pairs and
    # tokens batching) and every kill point: one process killed mid-epoch (3), at the epoch boundary (step 6)
    # and in the last steps (of 8), resuming three times; two FSDP2 ranks with loader workers, batching by
    # tokens, killed mid-epoch. (Each further case costs an uninterrupted run, a killed run and a resume: it was
    # four cases, the dimensions paired otherwise, for 5 launches more and the same dimensions proved.)
    pytest.param((3, 6, 7), 1, 0, "pairs", id="3,6,7-1-0-pairs"),
    pytest.param((3,), 2, 2, "tokens", id="3-2-2-tokens"),
]


def _run_config(tmp, dataset, tokenizer, name, world, workers, batching) -> tuple:
    return config(
        tmp,
        dataset,
        tokenizer,
        name,
        data__num_workers=workers,
        data__batching=batching,
        distributed__strategy="fsdp" if world > 1 else "ddp",
    )


@pytest.fixture(scope="module")
def uninterrupted(small_dataset, smollm2_dir, tmp_path_factory):
    """One uninterrupted run per (world, workers, batching), computed on first use: one process in this one
    (`train_here` with `invoke`), 2 ranks spawned (`rank_worker`). Each is the reference the tests compare launched
    runs to; its own process boundary is not what they check."""
    runs = {}

    def get(world, workers, batching):
        key = (world, workers, batching)
        if key not in runs:
            tmp = tmp_path_factory.mktemp("full")
            path, out = _run_config(tmp, small_dataset, smollm2_dir, "full", world, workers, batching)
            if world == 1:
                train_here(invoke, path)
            else:
                spawn(rank_worker, world, [(str(path), False)])
            runs[key] = out
        return runs[key]

    return get


@pytest.fixture(scope="module")
def killed(small_dataset, smollm2_dir, tmp_path_factory):
    """One run per (world, workers, batching, k), SIGKILLed right after committing step k, computed on first use;
    tests resume copies of it (shutil.copytree), never it."""
    runs = {}

    def get(world, workers, batching, k):
        key = (world, workers, batching, k)
        if key not in runs:
            tmp = tmp_path_factory.mktemp("killed")
            path, out = _run_config(tmp, small_dataset, smollm2_dir, "cut", world, workers, batching)
            attempt = train(path, nproc=world, env={"DPO_TRAIN_KILL": f"after-save:{k}"}, check=None)
            assert attempt.returncode != 0  # the process group died by SIGKILL right after committing step k
            assert _inspect_step(out) == k
            runs[key] = out
        return runs[key]

    return get


def _inspect_step(out: Path) -> int:
    """The step `dpo-state inspect --json` reports, run in this process: it reads JSON only, and an interpreter
    start would be most of it."""
    return json.loads(state_here(invoke, "inspect", out, "--json").stdout)["step"]


def _step_dir(out: Path, k: int) -> Path:
    return out / "checkpoints" / f"step-{k:06d}"


@pytest.mark.slow
@pytest.mark.parametrize("kills, world, workers, batching", CASES)
def test_sigkill_after_step_k_then_resume_is_bitwise_identical(
    kills, world, workers, batching, uninterrupted, killed, small_dataset, smollm2_dir, tmp_path, run_cli
):
    """Killed after step k, resumed (and killed again after each later k, so one run resumes twice), the run
    ends with the uninterrupted run's metrics and bitwise its model and optimizer state."""
    full = uninterrupted(world, workers, batching)
    path, out = _run_config(tmp_path, small_dataset, smollm2_dir, "cut", world, workers, batching)
    shutil.copytree(killed(world, workers, batching, kills[0]), out)
    for before, k in zip(kills, kills[1:]):
        again = train(path, nproc=world, env={"DPO_TRAIN_KILL": f"after-save:{k}"}, check=None)
        assert again.returncode != 0 and f"resumed from {_step_dir(out, before)}" in again.stderr
        assert json.loads(state_here(run_cli, "inspect", out, "--json").stdout)["step"] == k
    # the last resume is not killed: one process runs in this one (train_here), 2 ranks are launched
    resumed = train_here(run_cli, path) if world == 1 else train(path, nproc=world)
    assert f"resumed from {_step_dir(out, kills[-1])}" in resumed.stderr
    assert metrics(out) == metrics(full)  # every step's metrics, timing aside
    # dpo-state in this process (state_here): it reads files only, and torch's import would be most of a diff
    same = state_here(run_cli, "diff", full, out, "--values", code=None)
    assert same.exit_code == 0, same.stdout[-3000:]  # model and optimizer state bitwise equal (atol 0)


@pytest.mark.slow
def test_sigkill_during_saves_never_breaks_the_latest_checkpoint(
    small_dataset, smollm2_dir, tmp_path, uninterrupted, run_cli
):
    """One run killed again and again: at each phase of a save, then at random moments, each attempt resuming
    from the last. After every kill the latest committed checkpoint verifies and the next attempt reports the
    partial one and ignores it; the run still ends identical to an uninterrupted one."""
    full = uninterrupted(1, 0, "pairs")
    rng = random.Random(0)
    path, out = config(tmp_path, small_dataset, smollm2_dir, "crash")
    kills = [f"in-save:{s}:{phase}" for s, phase in ((2, "after-dcp"), (3, "after-rank-files"), (4, "after-state"))]
    kills += ["random"] * 3
    partial: list[Path] = []
    reported = 0
    for trial, kill in enumerate([*kills, None]):
        if kill is None:
            stderr = train_here(run_cli, path).stderr  # the last attempt runs to the end: not killed, in-process
        elif kill == "random":
            stderr = _kill_at_random(path, rng, tmp_path / f"attempt-{trial}.err")
        else:
            attempt = train(path, env={"DPO_TRAIN_KILL": kill}, check=None)
            assert attempt.returncode != 0, f"trial {trial} ({kill})"
            stderr = attempt.stderr
        for c in partial:  # the previous attempt's unfinished save, newer than its latest commit
            assert f"ignoring incomplete checkpoint {c}" in stderr, f"trial {trial} ({kill})"
            reported += 1
        checkpoints = sorted((out / "checkpoints").glob("step-*"))
        committed = [c for c in checkpoints if (c / "commit.json").is_file()]
        latest = int(committed[-1].name[5:]) if committed else -1
        partial = [c for c in checkpoints if c not in committed and int(c.name[5:]) > latest]
        if committed:
            assert state_here(run_cli, "verify", out, code=None).exit_code == 0, f"trial {trial} ({kill})"
    assert partial == [] and reported >= 3  # each kill inside a save left a partial checkpoint behind
    assert metrics(out) == metrics(full)


def _kill_at_random(path, rng, stderr_path) -> str:
    """Start an attempt, wait for it to commit a checkpoint newer than those it started with, then SIGKILL its
    process group a random moment later (unless it finished first); return its stderr."""
    checkpoints = Path(yaml.safe_load(path.read_text())["train"]["output_dir"]) / "checkpoints"
    committed = lambda: {c.parent.name for c in checkpoints.glob("*/commit.json")}  # noqa: E731
    before = committed()
    with open(stderr_path, "w") as stderr:
        proc = subprocess.Popen(
            [sys.executable, "-m", "dpo_cli.train", str(path), "--quiet"],
            start_new_session=True,
            stdout=subprocess.DEVNULL,
            stderr=stderr,
        )
        deadline = time.monotonic() + 120
        while not committed() - before:
            if proc.poll() is not None:  # it finished: an earlier attempt had committed the last step already
                assert proc.returncode == 0, stderr_path.read_text()[-3000:]
                break
            assert time.monotonic() < deadline
            time.sleep(0.01)
        time.sleep(rng.uniform(0, 0.25))
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return stderr_path.read_text()


@pytest.mark.slow
def test_resume_refuses_a_different_run_listing_every_mismatch(small_dataset, smollm2_dir, tmp_path, run_cli):
    """dpo-train in this process (train_here): the identity checks and resume choices need no process of
    their own, and six interpreter starts would be most of this test."""
    path, out = config(tmp_path, small_dataset, smollm2_dir, "run", train__max_steps=2)
    train_here(run_cli, path)
    changed = train_here(
        run_cli,
        path,
        "--set",
        "loss.beta=0.2",
        "--set",
        "optim.eps=1e-6",
        "--set",
        "data.seed=1",
        "--set",
        "train.max_steps=4",
        code=2,
    )
    for expected in (
        "objective.beta: checkpoint 0.1, this run 0.2",
        "optimizer.hyperparameters[0].eps",
        "layout.data_seed: checkpoint 0, this run 1",
        "train.weights_from",
        "refusing to resume",
    ):
        assert expected in changed.stderr
    tokens = train_here(run_cli, path, "--set", "data.batching=tokens", "--set", "train.max_steps=4", code=2)
    assert "layout.batching: checkpoint pairs, this run tokens" in tokens.stderr
    by_path = train_here(run_cli, path, "--set", f"train.resume={_step_dir(out, 1)}")
    assert f"resumed from {_step_dir(out, 1)} at step 1" in by_path.stderr
    never = train_here(run_cli, path, "--set", "train.resume=never", code=2)
    assert "already holds committed checkpoints" in never.stderr
    fresh = config(
        tmp_path,
        small_dataset,
        smollm2_dir,
        "fresh",
        train__max_steps=1,
        train__save_every=0,
        train__weights_from=str(out),
    )[0]
    train_here(run_cli, fresh)  # a new run from the weights alone: allowed, explicitly


def test_a_resume_under_another_release_says_which(small_dataset, smollm2_dir, tmp_path, run_cli, installed):
    """A checkpoint records the releases it was trained with; a resume under others goes on and says which,
    and inspect and diff show them."""
    path, out = config(tmp_path, small_dataset, smollm2_dir, "run", train__max_steps=2)
    train_here(run_cli, path)
    first = json.loads((_step_dir(out, 1) / "state.json").read_text())["environment"]
    assert first == environment() and first["torch"] == metadata.version("torch")
    installed("torch", "2.99.0")
    resumed = train_here(run_cli, path, "--set", f"train.resume={_step_dir(out, 1)}")
    said = [line for line in resumed.stderr.splitlines() if "another release" in line]
    assert said == [
        f"warning: resuming under another release (environment.torch: checkpoint {first['torch']}, this run "
        "2.99.0): the same steps; their numbers may differ from the first run's"
    ]
    shown = state_here(run_cli, "inspect", _step_dir(out, 2)).stdout
    assert f"libraries   python {first['python']}, torch 2.99.0, torchdata" in shown
    changed = state_here(run_cli, "diff", _step_dir(out, 1), _step_dir(out, 2), "--json", code=1).stdout
    assert json.loads(changed)["sections"]["environment"] == [{"path": "torch", "a": first["torch"], "b": "2.99.0"}]
    # written before the record: nothing to compare, nothing said
    state = json.loads((_step_dir(out, 1) / "state.json").read_text())
    del state["environment"]
    (_step_dir(out, 1) / "state.json").write_text(json.dumps(state))
    write_commit(_step_dir(out, 1), 1)
    older = train_here(run_cli, path, "--set", f"train.resume={_step_dir(out, 1)}")
    assert f"resumed from {_step_dir(out, 1)} at step 1" in older.stderr and "another release" not in older.stderr
    assert "libraries   not recorded" in state_here(run_cli, "inspect", _step_dir(out, 1)).stdout


@pytest.mark.slow
def test_retention_keeps_the_newest_and_a_failing_save_on_one_rank_commits_nothing(
    small_dataset, smollm2_dir, tmp_path, uninterrupted, run_cli
):
    full = uninterrupted(1, 0, "pairs")  # 8 steps, saving every step, keep_last 2
    assert sorted(p.name for p in (full / "checkpoints").iterdir()) == ["step-000007", "step-000008"]
    path, out = config(tmp_path, small_dataset, smollm2_dir, "fault", train__max_steps=4, train__save_every=2)
    failed = train(path, nproc=2, env={"DPO_TRAIN_SAVE_FAULT": "1:4"}, check=1)
    assert "saving step 4 failed, nothing was committed" in failed.stderr and "rank 1: OSError" in failed.stderr
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-000002"]
    state_here(run_cli, "verify", out)


@pytest.mark.slow
def test_pairs_mode_resumes_elastically_on_another_world_size(
    small_dataset, smollm2_dir, tmp_path, uninterrupted, killed
):
    """Saved by 1 process, resumed by 2: the same pairs per step (data-exact), reported as elastic. The 2 ranks
    are spawned (`rank_worker`: dpo-train's rank code, no torchrun launch; the launches are the other tests')."""
    full = uninterrupted(1, 0, "pairs")
    path, out = _run_config(tmp_path, small_dataset, smollm2_dir, "elastic", 1, 0, "pairs")
    shutil.copytree(killed(1, 0, "pairs", 3), out)  # saved by 1 process after step 3
    spawn(rank_worker, 2, [(str(path), False)], str(tmp_path / "stderr"))
    resumed = (tmp_path / "stderr.0").read_text()
    assert "elastic resume (layout.world_size: checkpoint 1, this run 2)" in resumed, resumed[-3000:]
    for a, b in zip(metrics(full), metrics(out)):
        assert (a["step"], a["pairs"], a["input_tokens"], a["sources"].keys()) == (
            b["step"],
            b["pairs"],
            b["input_tokens"],
            b["sources"].keys(),
        )
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-4)
    assert len(metrics(out)) == 8 and [r["world_size"] for r in metrics(out)] == [1] * 3 + [2] * 5
