"""Save and resume a run: model and optimizer through DCP, JSON and safetensors state, a commit record last.

A checkpoint is OUTPUT/checkpoints/step-NNNNNN/ holding `dcp/` (torch.distributed.checkpoint), `state.json`
(global), `rank-RRRRR.json` (the loader state) and `rank-RRRRR.rng.safetensors` (RNG states) per rank,
and `commit.json`, written last by rename. Only a committed checkpoint whose files match the record
is ever read; DCP's pickled `.metadata` is hash-checked before DCP opens it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import uuid
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from dpo_state.commit import commit_problems, write_commit
from dpo_state.digest import sha256_json
from dpo_state.jsonfile import StateFileError, read_json, write_json_atomic
from dpo_state.layout import list_checkpoints, resolve, retain, step_dir
from dpo_state.state import CHECKPOINT_FORMAT_VERSION, STATE_FILE, identity_mismatches, normalized, read_state
from dpo_train.config import ConfigError, TrainConfig

DCP_DIR = "dcp"
KILL_ENV = "DPO_TRAIN_KILL"
"""Testing hook for crash tests: `after-save:STEP` or `in-save:STEP:PHASE` SIGKILLs this process group there."""
SAVE_FAULT_ENV = "DPO_TRAIN_SAVE_FAULT"
"""Testing hook: RANK:STEP makes that rank's save of that step raise an OSError (abort-on-all tests)."""


class CheckpointError(RuntimeError):
    """A save that could not complete on every rank (the previous checkpoint stays the latest)."""


class ResumeError(ValueError):
    """A checkpoint that must not be resumed into this run; lists every reason and how to proceed."""


def rank_files(rank: int) -> tuple[str, str]:
    return f"rank-{rank:05d}.json", f"rank-{rank:05d}.rng.safetensors"


# ---------------------------------------------------------------- identity


def run_identity(trainer, loader) -> dict:
    """What a checkpoint must share with the run that resumes it (compared part by part)."""
    config: TrainConfig = trainer.config
    store = loader.stream.store
    group_keys = ("betas", "eps", "weight_decay", "amsgrad", "maximize", "momentum", "dampening", "nesterov",
                  "initial_lr")
    geometry = loader.config
    return normalized({
        "dataset": {"fingerprint": store.fingerprint, "datasets": store.dataset_fingerprints,
                    "num_pairs": store.num_pairs},
        "tokenizer": {"fingerprint": store.tokenizer_fingerprint, "attestation": store.tokenizer_attestation},
        "reference": {"mode": config.reference.mode if config.loss.needs_reference else "none",
                      "weights_fingerprint": trainer.weights,
                      "sidecar_table": trainer.table.sha256 if trainer.table is not None else None},
        "objective": {"type": config.loss.type, **{k: v for k, v in vars(config.loss).items() if k != "type"}},
        "optimizer": {
            "class": type(trainer.optimizer).__name__,
            "hyperparameters": [{k: g[k] for k in group_keys if k in g} for g in trainer.optimizer.param_groups],
            "parameters": [[name, list(p.shape)] for name, p in trainer.policy.named_parameters()],
        },
        "scheduler": {"class": type(trainer.scheduler).__name__, "kind": config.optim.scheduler,
                      "warmup_steps": config.optim.warmup_steps,
                      "max_steps": config.train.max_steps if config.optim.scheduler != "constant" else None},
        "layout": {"world_size": trainer.world, "strategy": config.distributed.strategy,
                   "batching": geometry.batching, "pairs_per_step": geometry.pairs_per_step,
                   "max_tokens_per_microbatch": geometry.max_tokens_per_microbatch,
                   "microbatches_per_step": geometry.microbatches_per_step, "num_workers": geometry.num_workers,
                   "data_seed": geometry.seed, "weights": list(geometry.weights) if geometry.weights else None,
                   "precision": trainer.place.precision, "train_seed": config.train.seed},
    })


# ---------------------------------------------------------------- save


def save(trainer, loader, out: Path, lineage: dict) -> Path:
    """Save after optimizer step `trainer.step_index` on every rank; commit on rank 0 once all succeeded."""
    from torch.distributed.checkpoint.state_dict import get_state_dict
    import torch.distributed.checkpoint as dcp

    rank, world, step = trainer.rank, trainer.world, trainer.step_index
    _agree(step, world)  # every rank is at the same step before anyone writes
    directory = step_dir(out, step)
    if rank == 0:
        if directory.exists():  # a save that never committed, or a damaged checkpoint resume skipped
            (directory / "commit.json").unlink(missing_ok=True)  # first: a half-removed one reads as incomplete
            shutil.rmtree(directory)
        directory.mkdir(parents=True)
    _barrier(world)
    failure = ""
    try:
        model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer)
        with _single_process_ok():
            # two writer threads per rank: about 1.8x faster than DCP's default of one (benchmarks/checkpoint_bench.py)
            writer = dcp.FileSystemWriter(str(directory / DCP_DIR), thread_count=2)
            dcp.save({"model": model_state, "optim": optim_state}, storage_writer=writer, no_dist=world == 1)
        _kill_point(f"in-save:{step}:after-dcp")
        if os.environ.get(SAVE_FAULT_ENV) == f"{rank}:{step}":
            raise OSError(f"injected save fault ({SAVE_FAULT_ENV}) on rank {rank}")
        loader_state = loader.state_dict()
        _write_rank_files(directory, rank, loader_state)
        _kill_point(f"in-save:{step}:after-rank-files")
        tensors = {"model": _tensor_summary(model_state), "optim": _tensor_summary(optim_state)}
    except Exception as e:  # noqa: BLE001 - reported to every rank below
        failure = f"rank {rank}: {type(e).__name__}: {e}"
    failures = _gather_failures(failure, world)
    if failures:
        if rank == 0:
            shutil.rmtree(directory, ignore_errors=True)
        raise CheckpointError(f"saving step {step} failed, nothing was committed (the previous checkpoint stays "
                              "the latest): " + "; ".join(failures))
    if rank == 0:
        document = _state_document(trainer, loader, loader_state["position"], tensors, lineage, world)
        write_json_atomic(directory / STATE_FILE, document)
        _kill_point(f"in-save:{step}:after-state")
        write_commit(directory, step)
        _kill_point(f"in-save:{step}:after-commit")
        retain(out, trainer.config.train.keep_last, writing=directory)
    _barrier(world)
    _kill_point(f"after-save:{step}")
    return directory


def _write_rank_files(directory: Path, rank: int, loader_state: dict) -> None:
    from safetensors.torch import save_file

    state_name, rng_name = rank_files(rank)
    write_json_atomic(directory / state_name, {"rank": rank, "loader": loader_state})
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    save_file(rng, str(directory / rng_name))


def _state_document(trainer, loader, position: dict, tensors: dict, lineage: dict, world: int) -> dict:
    resolved = trainer.config.resolved()
    return normalized({
        "format_version": CHECKPOINT_FORMAT_VERSION,
        "step": trainer.step_index, "epoch": position["epoch"],
        "loader": {"position": position, "batching": loader.config.batching},
        "consumed": {k: int(v) for k, v in trainer.consumed.items()},
        "config": resolved, "config_sha256": "sha256:" + sha256_json(resolved),
        "identity": run_identity(trainer, loader),
        "scheduler_state": trainer.scheduler.state_dict(),
        "rng": {"format": "safetensors", "keys": ["cpu", "cuda (when used)"]},
        "tensors": tensors,
        "ranks": [{"rank": r, "state": rank_files(r)[0], "rng": rank_files(r)[1], "position": position}
                  for r in range(world)],
        "package": {"name": "dpo-toolkit", "version": _version()},
        "lineage": lineage,
    })


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


# ---------------------------------------------------------------- resume


def find_resume(config: TrainConfig, out: Path, rank: int) -> Path | None:
    """The checkpoint to resume from, verified, or None for a fresh start.

    auto: the newest committed checkpoint whose files match their commit record; incomplete or failing
    ones are reported and skipped (with train.resume_strict, a failing one stops the run).
    never: a fresh start, refused if the output directory already holds committed checkpoints.
    PATH: that step directory (or a run directory's latest); it must verify.
    """
    mode = config.train.resume
    if mode == "never":
        listing = list_checkpoints(out)
        if listing.committed:
            raise ResumeError(f"train.resume is never but {out} already holds committed checkpoints "
                              f"(latest {listing.latest.name}); use a new train.output_dir, delete them, "
                              "or set train.resume: auto")
        return None
    if mode != "auto":
        return _verified("train.resume", mode)
    listing = list_checkpoints(out)
    for step, path in listing.incomplete:
        _report(rank, f"ignoring incomplete checkpoint {path} (no commit record: a save that never finished)")
    for step, path in reversed(listing.committed):
        problems = commit_problems(path)
        if not problems:
            return path
        message = f"checkpoint {path} does not verify:\n  - " + "\n  - ".join(problems)
        if config.train.resume_strict:
            raise ResumeError(message + "\n  train.resume_strict is set; repair or delete it, or unset resume_strict")
        _report(rank, "skipping " + message)
    return None


def restore(trainer, loader, path: Path) -> dict:
    """Check identity (fail closed), then load model, optimizer, scheduler, loader and RNG state."""
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    import torch.distributed.checkpoint as dcp

    try:
        state = read_state(path)
    except StateFileError as e:
        raise ResumeError(f"checkpoint {path}: {e}") from None
    mismatches, elastic = identity_mismatches(state["identity"], run_identity(trainer, loader))
    if mismatches:
        raise ResumeError(
            f"checkpoint {path} was made by a different run; refusing to resume into it:\n  - "
            + "\n  - ".join(mismatches)
            + "\n  to proceed: restore the original settings; or start a new run (a new train.output_dir) from "
              f"these weights alone with --set train.weights_from={path}; or set train.resume: never in a new "
              "output directory")
    for line in elastic:
        _report(trainer.rank, f"elastic resume ({line}): the same steps, re-dealt; not bitwise identical")
    problems = commit_problems(path)  # hashes again, just before DCP unpickles .metadata
    if problems:
        raise ResumeError(f"checkpoint {path} changed while resuming:\n  - " + "\n  - ".join(problems))
    model_state, optim_state = get_state_dict(trainer.model, trainer.optimizer)
    loaded = {"model": model_state, "optim": optim_state}
    with _single_process_ok():
        dcp.load(loaded, checkpoint_id=str(path / DCP_DIR), no_dist=trainer.world == 1)
    set_state_dict(trainer.model, trainer.optimizer, model_state_dict=loaded["model"],
                   optim_state_dict=loaded["optim"])
    trainer.scheduler.load_state_dict(state["scheduler_state"])
    saved_world = len(state["ranks"])
    source_rank = trainer.rank if saved_world == trainer.world else 0  # elastic: positions are equal on all ranks
    try:
        rank_state = read_json(path / rank_files(source_rank)[0])
    except StateFileError as e:
        raise ResumeError(f"checkpoint {path}: {e}") from None
    loader.load_state_dict(rank_state["loader"])
    if saved_world == trainer.world:
        _restore_rng(path / rank_files(trainer.rank)[1])
    trainer.step_index = state["step"]
    trainer.consumed.update(state["consumed"])
    return state


def load_weights(policy, path: str) -> None:
    """train.weights_from: only the model weights of a committed, verified checkpoint, loaded into the
    unwrapped policy before the reference is copied from it (a new run: no identity check)."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict
    import torch.distributed.checkpoint as dcp

    directory = _verified("train.weights_from", path)
    state = {"model": get_model_state_dict(policy)}
    with _single_process_ok():
        dcp.load(state, checkpoint_id=str(directory / DCP_DIR), no_dist=True)
    set_model_state_dict(policy, state["model"])


def _verified(key: str, path: str) -> Path:
    """The checkpoint a setting names (a step or run directory), whose files match its commit record."""
    try:
        directory = resolve(path)
    except FileNotFoundError as e:
        raise ResumeError(f"{key}: {e}") from None
    problems = commit_problems(directory)
    if problems:
        raise ResumeError(f"{key}: checkpoint {directory} does not verify:\n  - " + "\n  - ".join(problems))
    return directory


@contextlib.contextmanager
def _single_process_ok():
    """DCP warns that an uninitialized process group means a single-process save or load: intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        yield


def _restore_rng(path: Path) -> None:
    from safetensors.torch import load_file

    rng = load_file(str(path))
    torch.set_rng_state(rng["cpu"])
    if "cuda" in rng and torch.cuda.is_available():
        torch.cuda.set_rng_state(rng["cuda"])


def new_lineage() -> dict:
    return {"run_id": uuid.uuid4().hex, "parent": None, "resumed_from": None}


# ---------------------------------------------------------------- collectives and hooks


def _agree(step: int, world: int) -> None:
    if world == 1:
        return
    lo = torch.tensor([step], dtype=torch.int64)
    hi = lo.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX)
    if int(lo) != int(hi):
        raise CheckpointError(f"ranks disagree on the step to save (steps {int(lo)} to {int(hi)}); nothing saved")


def _gather_failures(failure: str, world: int) -> list[str]:
    if world == 1:
        return [failure] if failure else []
    flags = torch.tensor([1 if failure else 0], dtype=torch.int64)
    dist.all_reduce(flags)
    if not int(flags):
        return []
    messages: list[Any] = [None] * world
    dist.all_gather_object(messages, failure)  # in-memory between live ranks, never from disk
    return [m for m in messages if m]


def _barrier(world: int) -> None:
    if world > 1:
        dist.barrier()


def _kill_point(name: str) -> None:
    if os.environ.get(KILL_ENV) == name:
        sys.stderr.flush()
        os.killpg(os.getpgid(0), signal.SIGKILL)


def _report(rank: int, message: str) -> None:
    if rank == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)


def _version() -> str:
    from dpo_data import __version__

    return __version__


def check_resume_config(config: TrainConfig) -> None:
    if config.train.weights_from and config.train.resume not in ("auto", "never"):
        raise ConfigError("train.weights_from starts a new run from a checkpoint's weights; it cannot be combined "
                          f"with train.resume: {config.train.resume}")
