"""What tests share: tiny model and run configs, an in-process Trainer, the CLIs in a process of their own, a free
port, gloo groups."""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.tiny import TINY_LLAMA


class LiveTensors:
    """While open, every CPU tensor allocation and free, through the profiler's memory events (the one record of
    them PyTorch keeps on the CPU); `peak_mib` is then the highest sum of live tensor bytes: on the CPU what
    `torch.cuda.max_memory_allocated` counts on a GPU, free of the host allocator's retention that RSS includes.
    Tensors alive before it opened are not counted. The profiler holds every op's event: for a few steps (used by
    benchmarks/long_pairs.py --live, and by the tests that bound a computation's memory)."""

    def __enter__(self) -> LiveTensors:
        from torch.profiler import ProfilerActivity, profile

        self._profile = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
        self._profile.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._profile.__exit__(*exc)
        from torch.autograd import DeviceType

        events = [e for e in self._profile.profiler.kineto_results.events() if e.name() == "[memory]"]
        live = peak = 0
        for e in sorted(events, key=lambda e: e.start_ns()):
            if e.device_type() == DeviceType.CPU:  # a GPU run's device tensors have their own counter
                live += e.nbytes()  # negative for a free
                peak = max(peak, live)
        self.peak_mib = peak / (1 << 20)


def tiny_config(dataset: Path, tokenizer: Path, output_dir: Path, **train: Any) -> dict:
    """The smallest real run: TINY_LLAMA (seed 0) on `dataset`, 4 pairs a step in micro-batches of 400 tokens,
    AdamW at lr 1e-3; `train` adds to the train section."""
    return {
        "model": {"init": {"config": TINY_LLAMA, "seed": 0}, "tokenizer": str(tokenizer)},
        "data": {"path": str(dataset), "pairs_per_step": 4, "max_tokens_per_microbatch": 400},
        "optim": {"lr": 1.0e-3},
        "train": {"output_dir": str(output_dir), **train},
    }


def tiny_trainer(
    config: Any,
    *,
    rank: int = 0,
    world: int = 1,
    store: Any = None,
    mesh: Any = None,
    device: str = "cpu",
    precision: str | None = None,
) -> Any:
    """The real `Trainer` of rank `rank` of `world`, built in this process as the tests build it: `config` a
    TrainConfig, or a dict or YAML path that `load_config` reads; placed on `device` (CPU unless asked) at
    `precision` (None: the config's `train.precision`, whose `auto` is fp32 on CPU); over `store` (None: a new
    PairStore of `data.paths`) and `mesh` (None: the Trainer's own `run_mesh`). A process group, where `world`
    > 1, is the caller's (`join_gloo`). The config, placement and store are `trainer.config`, `.place`, `.store`."""
    from dpo_data.dataset.store import PairStore
    from dpo_train.config.loading import load_config
    from dpo_train.config.sections import TrainConfig
    from dpo_train.parallel.device import placement
    from dpo_train.run.setup import local_run
    from dpo_train.trainer import Trainer

    if not isinstance(config, TrainConfig):
        config = load_config(config)
    place = placement(device, config.train.precision if precision is None else precision)
    store = PairStore(config.data.paths) if store is None else store
    run = local_run(config, place, store, rank=rank, world=world)
    return Trainer(run if mesh is None else dataclasses.replace(run, mesh=mesh))


def write_yaml(path: Path, document: dict) -> Path:
    """Write `document` (a config) as YAML at `path`; returns `path`."""
    path.write_text(yaml.safe_dump(document))
    return path


# -- the CLIs in a process of their own, as a user's shell runs them; dpo-train also in-process ----------------

TIMEOUT_S = 600
"""A CLI run still going after this long has hung: it is killed (its whole process group) and the test fails."""
STDERR_TAIL = 4000
"""How much of a failed run's stderr the failure shows: its end, where the error is."""


def run_process(
    argv: list, *, env: dict | None = None, cwd: Path | None = None, code: int | None = 0, timeout: float = TIMEOUT_S
) -> subprocess.CompletedProcess:
    """Run `argv` with `env` added to this environment, capturing its text output. The exit status must be
    `code` (None: any) or the test fails showing the stderr tail; past `timeout` seconds the process and
    everything it started (its own session: torchrun's ranks too) are killed and the test fails."""
    argv = [str(a) for a in argv]
    shown = " ".join(["python", *argv[1:]] if argv[0] == sys.executable else argv)
    with subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=cwd,
        start_new_session=True,
    ) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):  # the whole group may have exited meanwhile
                os.killpg(proc.pid, signal.SIGKILL)
            _, stderr = proc.communicate()
            pytest.fail(f"{shown} did not finish within {timeout} s (killed); its stderr ends:\n{_tail(stderr)}")
    _check_exit(shown, proc.returncode, code, stderr)
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def _tail(stderr: str) -> str:
    return stderr[-STDERR_TAIL:]


def _check_exit(shown: str, got: int, code: int | None, stderr: str) -> None:
    if code is not None and got != code:
        pytest.fail(f"{shown} exited {got}, expected {code}; its stderr ends:\n{_tail(stderr)}")


def cli_argv(name: str, *args: Any) -> list[str]:
    """The command line of entry point dpo-`name` (train, data, state), run from this interpreter."""
    return [sys.executable, "-m", f"dpo_cli.{name}", *map(str, args)]


def train_cli(config: Path, *args: Any, nproc: int = 1, **run: Any) -> subprocess.CompletedProcess:
    """`dpo-train CONFIG --quiet ARGS` (`--nproc-per-node` when `nproc` > 1); `run` as for `run_process`."""
    launch = ["--nproc-per-node", nproc] if nproc > 1 else []
    return run_process(cli_argv("train", config, "--quiet", *args, *launch), **run)


def invoke(main: Any, *args: Any) -> Any:
    """Click entry point `main` with ARGS in this process: the click Result. What the `run_cli` fixture calls;
    a module fixture, which cannot take a function-scoped fixture, passes `invoke` where `run_cli` goes."""
    from click.testing import CliRunner

    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def rank_worker(rank: int, world: int, port: int, jobs: list, stderr: str | None = None) -> None:
    """One rank of `dpo-train --nproc-per-node WORLD` for `spawn`, as torchrun starts a rank: the rank variables
    set (LOCAL_WORLD_SIZE too), one intra-op thread (torchrun's OMP_NUM_THREADS=1 for several processes a
    node), and the call the CLI's rank makes, minus its exit, for each job (config path, precompute) in turn:
    `precompute_reference` (--precompute-reference) or `train`. Ranks forked from the fork server (torch and
    transformers preloaded), not launched: for runs whose torchrun agent and interpreter starts are not what a
    test checks (a reference run, a resume of a launched kill). One process group serves every job; each run
    builds its own mesh in it. `stderr`: where each rank's stderr goes (STDERR.RANK)."""
    import torch

    from dpo_train.config.loading import load_config
    from dpo_train.parallel import collectives
    from dpo_train.precompute import precompute_reference
    from dpo_train.trainer import train

    if stderr is not None:
        os.dup2(os.open(f"{stderr}.{rank}", os.O_WRONLY | os.O_CREAT | os.O_TRUNC), 2)
    torch.set_num_threads(1)
    join_gloo(rank, world, port)
    os.environ["LOCAL_WORLD_SIZE"] = str(world)
    for path, precompute in jobs:
        (precompute_reference if precompute else train)(load_config(path), progress=False)
    collectives.shutdown()
    sys.stderr.flush()


def train_here(run_cli: Any, config: Path, *args: Any, code: int | None = 0) -> Any:
    """`dpo-train CONFIG --quiet ARGS` in this process through the `run_cli` fixture: for a refusal or a short
    run, whose code path is the same in-process, no interpreter start nor imports (seconds each). The click
    Result, whose exit code must be `code` (None: any) or the test fails showing the stderr tail."""
    return _here(run_cli, "train", config, "--quiet", *args, code=code)


def state_here(run_cli: Any, *args: Any, code: int | None = 0) -> Any:
    """`dpo-state ARGS` in this process through the `run_cli` fixture, as `train_here`."""
    return _here(run_cli, "state", *args, code=code)


def data_here(run_cli: Any, *args: Any, code: int | None = 0) -> Any:
    """`dpo-data ARGS` in this process through the `run_cli` fixture, as `train_here` (a vision build's processor
    and transformers are imported once per test process, not once per command)."""
    return _here(run_cli, "data", *args, code=code)


def _here(run_cli: Any, name: str, *args: Any, code: int | None) -> Any:
    import importlib

    result = run_cli(importlib.import_module(f"dpo_cli.{name}").main, *args)
    _check_exit(f"dpo-{name} {' '.join(map(str, args))} (in-process)", result.exit_code, code, result.stderr)
    return result


def data_cli(*args: Any, **run: Any) -> subprocess.CompletedProcess:
    """`dpo-data ARGS`; `run` as for `run_process`."""
    return run_process(cli_argv("data", *args), **run)


def state_cli(*args: Any, **run: Any) -> subprocess.CompletedProcess:
    """`dpo-state ARGS`; `run` as for `run_process`."""
    return run_process(cli_argv("state", *args), **run)


GLOO_TIMEOUT = datetime.timedelta(seconds=120)
"""A collective that waits this long has hung (a rank died or diverged): it fails instead of stalling CI."""
SPAWN_TIMEOUT_S = 600
"""Spawned ranks that have not all finished by then are stopped and the test fails, naming the wait."""


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now (for a gloo rendezvous)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def join_gloo(rank: int, world: int, port: int) -> None:
    """Join a gloo group on 127.0.0.1:`port` as a torchrun rank would: the rank variables set (code under
    test reads them) and collectives failing after `GLOO_TIMEOUT` rather than waiting 30 minutes."""
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=GLOO_TIMEOUT)


SPAWN_PRELOAD = ("torch", "transformers", "dpo_train.trainer")
"""What the ranks' fork server imports once per test process: each rank is a fresh process forked from it, so it
starts with these loaded instead of importing them itself (seconds a rank, a dozen spawns in the suite). The
server is a fresh interpreter started at the first spawn (or loader worker) of the test process: a rank sees the
environment of that moment, so a worker sets what it needs itself (as `join_gloo` does)."""


def spawn(worker: Any, world: int, *args: Any, timeout_s: float = SPAWN_TIMEOUT_S) -> None:
    """Run `worker(rank, world, port, *args)` in `world` new processes (from a fork server, SPAWN_PRELOAD
    preloaded); a rank's exception fails the test (torch re-raises it), and ranks still running after
    `timeout_s` are killed and the test fails."""
    import multiprocessing
    import time

    import torch.multiprocessing as mp

    multiprocessing.set_forkserver_preload(list(SPAWN_PRELOAD))  # takes effect when the server starts
    context = mp.start_processes(
        worker, args=(world, free_port(), *args), nprocs=world, start_method="forkserver", join=False
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"{world} spawned ranks of {worker.__name__} did not finish within {timeout_s} s: a hang")
