"""What many tests share: the tiny model configs, a free port, and gloo groups that cannot hang CI."""

from __future__ import annotations

import datetime
import os
import socket
from typing import Any

import pytest

TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}
"""A random Llama with SmolLM2's vocabulary (the real tokenizer's ids embed), two small layers."""

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


def spawn(worker: Any, world: int, *args: Any, timeout_s: float = SPAWN_TIMEOUT_S) -> None:
    """Run `worker(rank, world, port, *args)` in `world` spawned processes; a rank's exception fails the
    test (torch re-raises it), and ranks still running after `timeout_s` are killed and the test fails."""
    import time

    import torch.multiprocessing as mp

    context = mp.start_processes(
        worker, args=(world, free_port(), *args), nprocs=world, start_method="spawn", join=False
    )
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=max(0.0, deadline - time.monotonic())):
        if time.monotonic() >= deadline:
            for process in context.processes:
                if process.is_alive():
                    process.kill()
            pytest.fail(f"{world} spawned ranks of {worker.__name__} did not finish within {timeout_s} s: a hang")
