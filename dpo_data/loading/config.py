"""`LoaderConfig`: how pairs become micro-batches (batching mode, budgets, world, workers, seed, mixture, layout)."""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from dpo_data.errors import DataError

BATCHING_MODES = ("pairs", "tokens")
LAYOUTS = ("separate", "shared_prompt")
MAX_WORKERS = 64
"""Loader workers per rank, at most, on any machine. A rank takes one micro-batch at a time and a worker packs
one in milliseconds (docs/benchmarks.md), so a few keep it fed; each is a process of its own."""
WORKERS_PER_CPU = 4
"""Workers on a machine per CPU, at most: they pack on the CPU, so more only contend for it (and for memory)."""
WORKER_BYTES = 256 << 20
"""The memory one worker is counted to take: a process with torch, numpy and pyarrow imported (about 200 MB
measured) and the micro-batches it prefetches."""
WORKER_MEMORY_SHARE = 0.5
"""The share of the available memory all workers together may take: the rest is the training processes'."""


@dataclass(frozen=True)
class Machine:
    """What the worker bound reads of this machine (`machine()`; tests give their own)."""

    cpus: int
    """CPUs this process may run on."""
    available_bytes: int | None
    """Memory new processes can take now; None where it cannot be read (nothing is then refused for it)."""
    processes: int
    """Training processes on this machine (torchrun's LOCAL_WORLD_SIZE), each starting its own workers."""


@dataclass(frozen=True)
class LoaderConfig:
    """How pairs become micro-batches. The names are the trainer config's `data` keys."""

    batching: str = "pairs"
    """'pairs': a step is a fixed number of pairs; 'tokens': micro-batches filled to the token budget."""
    max_tokens_per_microbatch: int = 1024
    """Token capacity of one micro-batch (input tokens of both segments of every pair in it)."""
    pairs_per_step: int | None = 8
    """pairs mode: pairs per optimizer step, over all ranks."""
    microbatches_per_step: int = 1
    """tokens mode: micro-batches per rank per optimizer step."""
    world_size: int = 1
    rank: int = 0
    num_workers: int = 0
    seed: int = 0
    weights: tuple[float, ...] | None = None
    """Per-dataset sampling factors for mixtures (1 = each pair once per epoch); None = all 1."""
    lookahead_pairs: int | None = None
    """tokens mode: pairs buffered ahead for packing; None = twice a step's expected pairs, at least 64."""
    layout: str = "separate"
    """'separate': [prompt + chosen][prompt + rejected]; 'shared_prompt': [prompt][chosen][rejected], the
    prompt once (for trainers whose attention supports it; budgets then count the prompt once)."""

    def __post_init__(self):
        if self.layout not in LAYOUTS:
            raise DataError(f"layout is {self.layout!r}; allowed: {', '.join(LAYOUTS)}")
        if self.batching not in BATCHING_MODES:
            raise DataError(f"batching is {self.batching!r}; allowed: {', '.join(BATCHING_MODES)}")
        for name in ("max_tokens_per_microbatch", "microbatches_per_step", "world_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise DataError(f"{name} is {getattr(self, name)!r}; it must be an integer >= 1")
        if self.batching == "pairs" and (not isinstance(self.pairs_per_step, int) or self.pairs_per_step < 1):
            raise DataError(f"pairs_per_step is {self.pairs_per_step!r}; pairs batching needs an integer >= 1")
        if not 0 <= self.rank < self.world_size:
            raise DataError(f"rank {self.rank} is outside world_size {self.world_size}")
        if self.num_workers:
            _check_workers(self.num_workers)

    def geometry(self, fingerprint: str) -> dict[str, Any]:
        """What a saved loader state must match to be resumed exactly."""
        g = asdict(self)
        g["weights"] = list(self.weights) if self.weights is not None else None
        g["fingerprint"] = fingerprint
        return g


def _check_workers(count: int) -> None:
    """Refuse a worker count this machine cannot hold (`worker_limit`). Refused, never lowered: the worker count
    is part of a checkpoint's layout, and a run in tokens batching resumes only with the same count."""
    most, why = worker_limit(machine())
    if not 0 <= count <= most:
        raise DataError(
            f"num_workers (data.num_workers) is {count}; allowed: 0 to {most} loader workers per rank here ({why}). "
            f"Fix: set it to {most} or less (0 loads in the training process itself)"
        )


def worker_limit(here: Machine) -> tuple[int, str]:
    """The most loader workers per rank `here` holds, and the bound that sets it: `MAX_WORKERS`, `WORKERS_PER_CPU`,
    or `WORKER_BYTES` each within `WORKER_MEMORY_SHARE` of the available memory."""
    per_rank = f"shared by {here.processes} training processes" if here.processes > 1 else "for one training process"
    limits = [
        (MAX_WORKERS, f"at most {MAX_WORKERS} on any machine"),
        (WORKERS_PER_CPU * here.cpus // here.processes, f"{WORKERS_PER_CPU} per CPU of {here.cpus}, {per_rank}"),
    ]
    if here.available_bytes is not None:
        room = int(here.available_bytes * WORKER_MEMORY_SHARE)
        limits.append(
            (
                room // (here.processes * WORKER_BYTES),
                f"{WORKER_BYTES >> 20} MB each within {WORKER_MEMORY_SHARE:.0%} of the "
                f"{here.available_bytes / 2**30:.1f} GiB of memory available now, {per_rank}",
            )
        )
    return min(limits)


def machine() -> Machine:
    """This machine now: its CPUs, the memory new processes can take, and the training processes sharing it."""
    try:
        processes = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        processes = 1
    cpus = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
    known = [room for room in (_mem_available(), _cgroup_room()) if room is not None]
    return Machine(cpus, min(known) if known else None, processes)


def _mem_available() -> int | None:
    """Linux's estimate of memory available to new processes without swapping (MemAvailable), else free pages."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return None


def _cgroup_room() -> int | None:
    """What this process's cgroup (v2: a container, a Slurm job) still allows; None without a limit."""
    root = Path("/sys/fs/cgroup")
    try:
        limit = (root / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((root / "memory.current").read_text()))
    except (OSError, ValueError):
        return None
