"""Saving a checkpoint: every rank writes its files through DCP, rank 0 commits last; a failed save on any rank
abandons it on all."""

from __future__ import annotations

import contextlib
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from dpo_state.commit import COMMIT_FILE, write_commit
from dpo_state.dcp_io import (
    DCP_DIR,
    quiet_single_process_dcp,
)
from dpo_state.digest import DIGEST_PREFIX, sha256_json
from dpo_state.disk import disk_errno, disk_fix
from dpo_state.faults import commit_fault, flip_written, save_fault, train_kill_point
from dpo_state.files import write_json_atomic
from dpo_state.layout import move_aside, retain, step_dir
from dpo_state.state import (
    CHECKPOINT_FORMAT_VERSION,
    RANK_FORMAT_VERSION,
    RANK_SCHEMA,
    STATE_FILE,
    STATE_SCHEMA,
    TREE_FILE,
    TREE_FORMAT_VERSION,
    TREE_SCHEMA,
    normalized,
    rank_files,
)
from dpo_train.checkpoint.interrupts import held_until_saved
from dpo_train.checkpoint.parts import Checkpointable, RunView, Stateful, dcp_tensors, warn
from dpo_train.checkpoint.read_back import read_back
from dpo_train.errors import CheckpointError
from dpo_train.model.lora import run_environment
from dpo_train.parallel import collectives


def save(parts: Checkpointable, run: RunView, identity: dict, lineage: dict, verify: bool = False) -> Path:
    """Save after optimizer step `parts.train.step` on every rank; commit on rank 0 once all succeeded.
    `identity`: what a run that resumes the checkpoint must share with this one (`checkpoint.identity`);
    `verify`: every rank first reads its share back and compares it with what the run holds (`read_back`).

    A failure on any rank, in the writes, the read-back or the commit, is a `CheckpointError` on every rank
    after rank 0 has removed the partial directory: the previous commit stays the latest and the disk is not
    left holding half a checkpoint.
    """
    rank, step = run.rank, parts.train.step
    with held_until_saved(step, announce=rank == 0):
        _agree(step)  # every rank is at the same step before anyone writes
        directory = step_dir(run.out, step)
        cleared = _guarded(rank, lambda: _clear_for(directory, run.out, step))[1] if rank == 0 else ""
        if failures := collectives.gather_failures(cleared):  # (every rank waits here for the room, as at a barrier)
            raise CheckpointError(_failed(step, failures, directory))  # nothing was written: nothing to remove
        written, failure = _guarded(rank, lambda: _write_this_rank(parts, run, directory))
        failures = collectives.gather_failures(failure)
        if verify and not failures:
            _read_back(parts, run, directory)
        positions = collectives.gather_objects(written["position"] if not failures else None)
        if not failures and rank == 0:
            commit = (positions, written)
            _, failure = _guarded(rank, lambda: _commit(parts, run, identity, directory, commit, lineage))
        failures = failures or collectives.gather_failures(failure)
        if failures:
            _abandon(directory, rank, step, failures)
        collectives.barrier()
        train_kill_point(f"after-save:{step}")
    return directory


def _read_back(parts: Checkpointable, run: RunView, directory: Path) -> None:
    """Every rank reads its share back before anything is committed; a difference on any abandons the save."""
    problem, failure = _guarded(run.rank, lambda: read_back(parts, run, directory))
    failures = collectives.gather_failures(failure or (f"rank {run.rank}: {problem}" if problem else ""))
    if failures:
        _abandon(
            directory,
            run.rank,
            parts.train.step,
            ["the checkpoint does not read back what was saved", *failures],
            "The run stopped at this process's first save instead of training on with checkpoints that would "
            "resume into other numbers. Likely causes: a filesystem that does not return what was written to it "
            f"(a network mount's cache), or a fault in torch {torch.__version__}'s checkpoint writer. Fix: a "
            "train.output_dir on another filesystem; if it happens there too, report it with the output of "
            "`dpo-state env`. train.read_back: false skips this check",
        )


def _clear_for(directory: Path, out: Path, step: int) -> None:
    """Make room for step `step`: a committed save of it goes aside (kept), an uncommitted one goes."""
    if (directory / COMMIT_FILE).is_file():  # committed checkpoints are only ever deleted by retention
        aside = move_aside(out, [directory], f"replaced-at-step-{step}")
        warn(0, f"moved the committed {directory.name} aside to {aside} before saving step {step} again")
    elif directory.exists():  # a save that never committed
        shutil.rmtree(directory)
    directory.mkdir(parents=True)


def _guarded(rank: int, work: Callable[[], Any]) -> tuple[Any, str]:
    """`work()`'s result and "", or None and rank `rank`'s failure named. DCP's `CheckpointException` (a full disk,
    a lost peer) is a BaseException, so the net is that wide; an interrupt or exit still propagates."""
    try:
        return work(), ""
    except (KeyboardInterrupt, SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 - any failure is reported to every rank
        if any(isinstance(x, KeyboardInterrupt) for x in _causes(e)):  # a second Ctrl-C, wrapped by DCP
            raise KeyboardInterrupt from e
        return None, f"rank {rank}: {_named(e)}"


def _named(e: BaseException) -> str:
    """One line per failure. DCP wraps each rank's error and its traceback in a CheckpointException, and
    torch's zip writer turns a full disk into "unexpected pos": the OSError under it is what a user fixes."""
    inner = [exc for exc, _ in getattr(e, "failures", {}).values()] or [e]
    return "; ".join(_root_cause(x) for x in inner)


def _root_cause(e: BaseException) -> str:
    pick = next((x for x in _chain(e) if isinstance(x, OSError)), e)
    return f"{type(pick).__name__}: {pick}"


def _chain(e: BaseException) -> list[BaseException]:
    """`e` and what it was raised from or while handling, outermost first (at most 16)."""
    chain = [e]
    while len(chain) < 16 and (chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    return chain


def _causes(e: BaseException) -> list[BaseException]:
    """Every exception behind `e`: its chain, and the chains of each rank's failure DCP wrapped in it."""
    inner = [exc for exc, _ in getattr(e, "failures", {}).values()]
    return [x for outer in [e, *inner] for x in _chain(outer)]


@contextlib.contextmanager
def _writer_threads_checked() -> Iterator[None]:
    """DCP's extra writer threads die alone: threading's hook prints their traceback and `dcp.save` never
    hears of it (its metadata then lacks their files). Collect what they raise and raise it here."""
    died: list[BaseException] = []
    previous, before = threading.excepthook, set(threading.enumerate())
    threading.excepthook = lambda args: died.append(args.exc_value)
    try:
        yield
    finally:
        # a failure in DCP's own thread leaves dcp.save before its writer threads end: wait for them, so
        # that what they raise lands here and not in threading's default hook (a traceback on stderr)
        for thread in set(threading.enumerate()) - before:
            thread.join(timeout=_WRITER_JOIN_S)
        threading.excepthook = previous
    if died:
        raise died[0]


_WRITER_JOIN_S = 120.0
"""How long a failed save waits for DCP's writer threads to end (each writes one file at a time)."""


def _write_this_rank(parts: Checkpointable, run: RunView, directory: Path) -> dict:
    """This rank's share: its DCP shards, loader state and RNG; returns what the commit needs of it."""
    import torch.distributed.checkpoint as dcp

    rank, step = run.rank, parts.train.step
    model_state = parts.model.state_dict()
    tensors = dcp_tensors(parts, model_state)
    with quiet_single_process_dcp(), _writer_threads_checked():
        # two writer threads per rank: about 1.8x faster than DCP's default of one (benchmarks/checkpoint_bench.py)
        writer = dcp.FileSystemWriter(str(directory / DCP_DIR), thread_count=2)
        dcp.save(tensors, storage_writer=writer, no_dist=run.world == 1)
    flip_written(rank, step, directory / DCP_DIR)
    train_kill_point(f"in-save:{step}:after-dcp")
    save_fault(rank, step)
    loader_state = parts.loader.state_dict()
    _write_rank_files(directory, rank, loader_state, parts.rng)
    train_kill_point(f"in-save:{step}:after-rank-files")
    summary = {group: _tensor_summary(value) for group, value in tensors.items()}
    return {"position": loader_state["position"], "tensors": summary, "tree": model_state["tree"]}


def _commit(
    parts: Checkpointable, run: RunView, identity: dict, directory: Path, ranks: tuple[list, dict], lineage: dict
) -> None:
    """Rank 0: the global documents, then the commit record (from here the checkpoint exists), then retention.
    `ranks`: every rank's loader position, and what this rank wrote."""
    step, (positions, written) = parts.train.step, ranks
    commit_fault(step)
    tree = {"format_version": TREE_FORMAT_VERSION, **written["tree"]}
    write_json_atomic(directory / TREE_FILE, tree, schema=TREE_SCHEMA)
    document = _state_document(parts, run, identity, positions, written["tensors"], lineage)
    write_json_atomic(directory / STATE_FILE, document, schema=STATE_SCHEMA)
    train_kill_point(f"in-save:{step}:after-state")
    write_commit(directory, step)
    train_kill_point(f"in-save:{step}:after-commit")
    retain(run.out, run.config.train.keep_last, lineage["run_id"], writing=directory)


def _abandon(directory: Path, rank: int, step: int, failures: list[str], fix: str | None = None) -> None:
    """Rank 0 removes the partial directory before any rank raises: a rank that exits first makes
    torchrun stop the others, and rank 0 must not be stopped half-way through the removal."""
    if rank == 0:
        (directory / COMMIT_FILE).unlink(missing_ok=True)  # a commit written before retention failed
        shutil.rmtree(directory, ignore_errors=True)
    collectives.barrier()
    raise CheckpointError(_failed(step, failures, directory, fix))


def _failed(step: int, failures: list[str], directory: Path, fix: str | None = None) -> str:
    """The message of a save that committed nothing: each rank's failure, and the fix (a full or read-only disk's
    names the filesystem of `directory`)."""
    code = disk_errno("; ".join(failures))
    if fix is None and code is not None:
        fix = f"Fix: {disk_fix(code, directory.parent)}, then rerun: the run resumes from the latest checkpoint"
    return (
        f"saving step {step} failed, nothing was committed (the previous checkpoint stays the latest): "
        + "; ".join(failures)
        + f". {fix or 'Fix the cause (free disk space, permissions) and rerun: the run resumes from that checkpoint'}"
    )


def _write_rank_files(directory: Path, rank: int, loader_state: dict, rng: Stateful) -> None:
    from safetensors.torch import save_file

    state_name, rng_name = rank_files(rank)
    document = {"format_version": RANK_FORMAT_VERSION, "rank": rank, "loader": loader_state}
    write_json_atomic(directory / state_name, document, schema=RANK_SCHEMA)
    save_file(rng.state_dict(), str(directory / rng_name))


def _state_document(
    parts: Checkpointable, run: RunView, identity: dict, positions: list, tensors: dict, lineage: dict
) -> dict:
    """state.json: rank 0's position is the run's; every rank's own position is recorded beside its files."""
    from dpo_data import __version__

    train, position, config = parts.train.state_dict(), positions[0], run.config.resolved()
    return normalized(
        {
            "format_version": CHECKPOINT_FORMAT_VERSION,
            "step": train["step"],
            "epoch": position["epoch"],
            "loader": {"position": position, "batching": run.config.data.batching},
            "consumed": train["consumed"],
            **({"early_stopping": train["early_stopping"]} if "early_stopping" in train else {}),
            "config": config,
            "config_sha256": DIGEST_PREFIX + sha256_json(config),
            "identity": identity,
            "scheduler_state": parts.scheduler.state_dict(),
            "rng": {"format": "safetensors", "keys": parts.rng.kinds},
            "tensors": tensors,
            "ranks": [
                {"rank": r, "state": rank_files(r)[0], "rng": rank_files(r)[1], "position": positions[r]}
                for r in range(run.world)
            ],
            "package": {"name": "dpo-toolkit", "version": __version__},
            "environment": run_environment(run.config.model.lora),
            "lineage": lineage,
        }
    )


def _tensor_summary(state: Any) -> dict:
    count, size = 0, 0
    stack = [state]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
        elif torch.is_tensor(item):
            count, size = count + 1, size + item.numel() * item.element_size()
    return {"count": count, "bytes": size}


def _agree(step: int) -> None:
    """Every rank is at `step`, else nothing is saved."""
    lo, hi = (int(x) for x in collectives.spread(torch.tensor([step], dtype=torch.int64)))
    if lo != hi:
        raise CheckpointError(f"ranks disagree on the step to save (steps {lo} to {hi}); nothing saved")
