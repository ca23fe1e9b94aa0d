"""Save and resume a run: model and optimizer through DCP, JSON and safetensors state, a commit record last.

A checkpoint is OUTPUT/checkpoints/step-NNNNNN/ holding `dcp/` (torch.distributed.checkpoint: the model and
optimizer tensors, and the reference's when TR-DPO moves it), `state.json`
(global), `rank-RRRRR.json` (the loader state) and `rank-RRRRR.rng.safetensors` (RNG states) per rank,
and `commit.json`, written last by rename. Only a committed checkpoint whose files match the record
is ever read. DCP holds tensors only; every non-tensor value of the model and optimizer state is JSON
(`state_tree.json`), and DCP's pickled `.metadata` is read through a restricted unpickler
(`dpo_state.dcp_io`), so no general unpickler ever runs on a checkpoint file (docs/security.md).

The checkpointer never sees the trainer: it receives `Checkpointable`, a typed set of `Stateful`
objects (as torchtitan's CheckpointManager does), and a `RunContext` saying where the rank sits and
what identity the run has.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import sys
import threading
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from dpo_state.audit import checkpoint_problems
from dpo_state.commit import COMMIT_FILE, write_commit
from dpo_state.dcp_io import (
    DCP_DIR,
    merge_tensors,
    quiet_single_process_dcp,
    read_dcp_metadata,
    reading_tensors,
    safe_reader,
    split_tensors,
)
from dpo_state.digest import DIGEST_PREFIX, sha256_json
from dpo_state.errors import DocumentError, StateError
from dpo_state.files import write_json_atomic
from dpo_state.layout import lineage_of, list_checkpoints, move_aside, resolve, retain, step_dir
from dpo_state.state import (
    CHECKPOINT_FORMAT_VERSION,
    RANK_FORMAT_VERSION,
    RANK_SCHEMA,
    STATE_FILE,
    STATE_SCHEMA,
    TREE_FILE,
    TREE_FORMAT_VERSION,
    TREE_SCHEMA,
    identity_mismatches,
    normalized,
    rank_files,
    read_rank_state,
    read_state,
    read_state_tree,
)
from dpo_train.config import TrainConfig
from dpo_train.early_stopping import EarlyStopping
from dpo_train.errors import CheckpointError, ResumeError
from dpo_train.parallel import collectives

KILL_ENV = "DPO_TRAIN_KILL"
"""Testing hook for crash tests: `after-save:STEP`, `in-save:STEP:PHASE` or `in-export:final` SIGKILLs this
process group there."""
SAVE_FAULT_ENV = "DPO_TRAIN_SAVE_FAULT"
"""Testing hook: RANK:STEP makes that rank's save of that step raise an OSError (abort-on-all tests);
commit:STEP makes rank 0's commit of that step raise one."""


class Stateful(Protocol):
    """torch.distributed.checkpoint's protocol: an object that can give and take its state."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainState:
    """Where the loop stands: optimizer steps taken, what they consumed, and the early-stopping watch."""

    step: int = 0
    consumed: dict[str, int] = field(default_factory=lambda: {"pairs": 0, "input_tokens": 0, "supervised_tokens": 0})
    early_stopping: EarlyStopping | None = None

    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "consumed": dict(self.consumed)}
        if self.early_stopping is not None:
            state["early_stopping"] = self.early_stopping.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.consumed = {k: int(v) for k, v in state["consumed"].items()}
        if self.early_stopping is not None:
            self.early_stopping.load_state_dict(state.get("early_stopping"))


class ModelAndOptimizer:
    """The policy and its optimizer as one Stateful, split for safe storage: `tensors` (sharded state
    dicts under FSDP2) go to DCP, `tree` (the structure and every non-tensor value) goes to JSON."""

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self._options())
        model_tensors, model_tree = split_tensors(model_state, "model")
        optim_tensors, optim_tree = split_tensors(optim_state, "optim")
        return {
            "tensors": {"model": model_tensors or {}, "optim": optim_tensors or {}},
            "tree": {"model": model_tree, "optim": optim_tree},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        tensors, tree = state["tensors"], state["tree"]
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=merge_tensors(tree["model"], tensors["model"]),
            optim_state_dict=merge_tensors(tree["optim"], tensors["optim"]),
            options=self._options(),
        )

    def _options(self):
        """Frozen parameters (the base weights under LoRA) are not saved: they are the model's own, checked
        by the reference weights fingerprint. Loading then fills only the trainable ones (DCP has already
        refused a checkpoint that lacks any of them)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        frozen = any(not p.requires_grad for p in self.model.parameters())
        return StateDictOptions(ignore_frozen_params=True, strict=not frozen)


class ReferenceWeights:
    """The live reference's weights once TR-DPO moves them (reference.sync_ref_model): tensors only, to DCP
    beside the policy's, sharded as the reference is (FSDP2 shards, or the whole copy)."""

    def __init__(self, model: Any):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state)


class RNGState:
    """This process's generator states, by device kind: cpu always, and the rank's accelerator (cuda, or
    npu through torch-npu, whose generators live in `torch.npu`) when the run is on one."""

    def __init__(self, device_kind: str = "cpu"):
        self.kinds = ["cpu"] if device_kind == "cpu" else ["cpu", device_kind]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {kind: _generator(kind).get_rng_state() for kind in self.kinds}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if sorted(state) != sorted(self.kinds):
            raise ResumeError(
                f"the checkpoint holds generator states for {', '.join(sorted(state))}, this run needs "
                f"{', '.join(self.kinds)}: it was saved on another device kind; resume on that kind, or start a "
                "new run from its weights with train.weights_from"
            )
        for kind in self.kinds:
            _generator(kind).set_rng_state(state[kind])


def _generator(kind: str) -> Any:
    """The module holding `kind`'s default generator: torch (cpu), torch.cuda, torch.npu."""
    return torch if kind == "cpu" else getattr(torch, kind)


@dataclass
class Checkpointable:
    """Everything a checkpoint holds, and where each part goes."""

    model: ModelAndOptimizer
    """-> dcp/ (tensors, sharded as trained) and state_tree.json (everything else, as JSON)."""
    scheduler: Stateful
    """-> state.json `scheduler_state`."""
    loader: Stateful
    """-> rank-RRRRR.json, one per rank."""
    rng: Stateful
    """-> rank-RRRRR.rng.safetensors, one per rank."""
    train: TrainState
    """-> state.json `step`, `consumed` and (with eval.early_stopping_metric) `early_stopping`."""
    reference: Stateful | None = None
    """-> dcp/ `reference` (tensors only), when the reference moves (TR-DPO); None: it is the initial policy,
    rebuilt on resume and checked by the reference weights fingerprint."""


@dataclass(frozen=True)
class RunContext:
    """What the checkpointer needs to know of the run, beyond its state."""

    out: Path
    rank: int
    world: int
    keep_last: int
    config: dict
    """The resolved config (recorded in state.json)."""
    identity: dict
    """What a checkpoint must share with a run that resumes it (see `dpo_train.identity`)."""
    batching: str


def new_lineage() -> dict:
    return {"run_id": uuid.uuid4().hex, "parent": None, "resumed_from": None}


# ---------------------------------------------------------------- save


def save(parts: Checkpointable, ctx: RunContext, lineage: dict) -> Path:
    """Save after optimizer step `parts.train.step` on every rank; commit on rank 0 once all succeeded.

    A failure on any rank, in the writes or in the commit, is a `CheckpointError` on every rank after
    rank 0 has removed the partial directory: the previous commit stays the latest and the disk is not
    left holding half a checkpoint.
    """
    rank, step = ctx.rank, parts.train.step
    _agree(step)  # every rank is at the same step before anyone writes
    directory = step_dir(ctx.out, step)
    if rank == 0:
        _clear_for(directory, ctx.out, step)
    collectives.barrier()
    written, failure = _guarded(rank, lambda: _write_this_rank(parts, ctx, directory))
    failures = collectives.gather_failures(failure)
    positions = collectives.gather_objects(written["position"] if not failures else None)
    if not failures and rank == 0:
        _, failure = _guarded(rank, lambda: _commit(parts, ctx, directory, positions, written, lineage))
    failures = failures or collectives.gather_failures(failure)
    if failures:
        _abandon(directory, rank, step, failures)
    collectives.barrier()
    kill_point(f"after-save:{step}")
    return directory


def _clear_for(directory: Path, out: Path, step: int) -> None:
    """Make room for step `step`: a committed save of it goes aside (kept), an uncommitted one goes."""
    if (directory / COMMIT_FILE).is_file():  # committed checkpoints are only ever deleted by retention
        aside = move_aside(out, [directory], f"replaced-at-step-{step}")
        _report(0, f"moved the committed {directory.name} aside to {aside} before saving step {step} again")
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
        return None, f"rank {rank}: {_named(e)}"


def _named(e: BaseException) -> str:
    """One line per failure. DCP wraps each rank's error and its traceback in a CheckpointException, and
    torch's zip writer turns a full disk into "unexpected pos": the OSError under it is what a user fixes."""
    inner = [exc for exc, _ in getattr(e, "failures", {}).values()] or [e]
    return "; ".join(_root_cause(x) for x in inner)


def _root_cause(e: BaseException) -> str:
    chain = [e]
    while len(chain) < 16 and (chain[-1].__cause__ or chain[-1].__context__) is not None:
        chain.append(chain[-1].__cause__ or chain[-1].__context__)
    pick = next((x for x in chain if isinstance(x, OSError)), e)
    return f"{type(pick).__name__}: {pick}"


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


def _write_this_rank(parts: Checkpointable, ctx: RunContext, directory: Path) -> dict:
    """This rank's share: its DCP shards, loader state and RNG; returns what the commit needs of it."""
    import torch.distributed.checkpoint as dcp

    rank, step = ctx.rank, parts.train.step
    model_state = parts.model.state_dict()
    tensors = _dcp_tensors(parts, model_state)
    with quiet_single_process_dcp(), _writer_threads_checked():
        # two writer threads per rank: about 1.8x faster than DCP's default of one (benchmarks/checkpoint_bench.py)
        writer = dcp.FileSystemWriter(str(directory / DCP_DIR), thread_count=2)
        dcp.save(tensors, storage_writer=writer, no_dist=ctx.world == 1)
    kill_point(f"in-save:{step}:after-dcp")
    if os.environ.get(SAVE_FAULT_ENV) == f"{rank}:{step}":
        raise OSError(f"injected save fault ({SAVE_FAULT_ENV}) on rank {rank}")
    loader_state = parts.loader.state_dict()
    _write_rank_files(directory, rank, loader_state, parts.rng)
    kill_point(f"in-save:{step}:after-rank-files")
    summary = {group: _tensor_summary(value) for group, value in tensors.items()}
    return {"position": loader_state["position"], "tensors": summary, "tree": model_state["tree"]}


def _dcp_tensors(parts: Checkpointable, model_state: dict) -> dict:
    """What DCP holds: the model and optimizer tensors, and the reference's when it moves."""
    reference = {"reference": parts.reference.state_dict()} if parts.reference is not None else {}
    return {**model_state["tensors"], **reference}


def _commit(
    parts: Checkpointable, ctx: RunContext, directory: Path, positions: list, written: dict, lineage: dict
) -> None:
    """Rank 0: the global documents, then the commit record (from here the checkpoint exists), then retention."""
    step = parts.train.step
    if os.environ.get(SAVE_FAULT_ENV) == f"commit:{step}":
        raise OSError(f"injected commit fault ({SAVE_FAULT_ENV})")
    tree = {"format_version": TREE_FORMAT_VERSION, **written["tree"]}
    write_json_atomic(directory / TREE_FILE, tree, schema=TREE_SCHEMA)
    document = _state_document(parts, ctx, positions, written["tensors"], lineage)
    write_json_atomic(directory / STATE_FILE, document, schema=STATE_SCHEMA)
    kill_point(f"in-save:{step}:after-state")
    write_commit(directory, step)
    kill_point(f"in-save:{step}:after-commit")
    retain(ctx.out, ctx.keep_last, lineage["run_id"], writing=directory)


def _abandon(directory: Path, rank: int, step: int, failures: list[str]) -> None:
    """Rank 0 removes the partial directory before any rank raises: a rank that exits first makes
    torchrun stop the others, and rank 0 must not be stopped half-way through the removal."""
    if rank == 0:
        (directory / COMMIT_FILE).unlink(missing_ok=True)  # a commit written before retention failed
        shutil.rmtree(directory, ignore_errors=True)
    collectives.barrier()
    raise CheckpointError(
        f"saving step {step} failed, nothing was committed (the previous checkpoint stays the latest): "
        + "; ".join(failures)
        + ". Fix the cause (free disk space, permissions) and rerun: the run resumes from that checkpoint"
    )


def _write_rank_files(directory: Path, rank: int, loader_state: dict, rng: Stateful) -> None:
    from safetensors.torch import save_file

    state_name, rng_name = rank_files(rank)
    document = {"format_version": RANK_FORMAT_VERSION, "rank": rank, "loader": loader_state}
    write_json_atomic(directory / state_name, document, schema=RANK_SCHEMA)
    save_file(rng.state_dict(), str(directory / rng_name))


def _state_document(parts: Checkpointable, ctx: RunContext, positions: list, tensors: dict, lineage: dict) -> dict:
    """state.json: rank 0's position is the run's; every rank's own position is recorded beside its files."""
    from dpo_data import __version__

    train, position = parts.train.state_dict(), positions[0]
    return normalized(
        {
            "format_version": CHECKPOINT_FORMAT_VERSION,
            "step": train["step"],
            "epoch": position["epoch"],
            "loader": {"position": position, "batching": ctx.batching},
            "consumed": train["consumed"],
            **({"early_stopping": train["early_stopping"]} if "early_stopping" in train else {}),
            "config": ctx.config,
            "config_sha256": DIGEST_PREFIX + sha256_json(ctx.config),
            "identity": ctx.identity,
            "scheduler_state": parts.scheduler.state_dict(),
            "rng": {"format": "safetensors", "keys": parts.rng.kinds},
            "tensors": tensors,
            "ranks": [
                {"rank": r, "state": rank_files(r)[0], "rng": rank_files(r)[1], "position": positions[r]}
                for r in range(ctx.world)
            ],
            "package": {"name": "dpo-toolkit", "version": __version__},
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


# ---------------------------------------------------------------- resume


def find_resume(config: TrainConfig, out: Path, rank: int) -> Path | None:
    """The checkpoint to resume from, verified, or None for a fresh start. Rank 0 chooses and verifies;
    every rank gets its choice, or fails with its one message.

    auto: the newest committed checkpoint that verifies, following the lineage (run id) of the newest
    committed one; incomplete or failing ones are reported and skipped (with train.resume_strict, a
    failing one stops the run). never: a fresh start, refused if the output directory already holds
    committed checkpoints. PATH: that step directory (or a run directory's latest); it must verify.
    """
    choice, error = None, ""
    if rank == 0:
        try:
            found = _choose(config, out)
            choice = str(found) if found is not None else None
        except ResumeError as e:
            error = str(e)
    choice, error = collectives.broadcast_from_rank0((choice, error))
    if error:
        raise ResumeError(error)
    return Path(choice) if choice is not None else None


def _choose(config: TrainConfig, out: Path) -> Path | None:
    mode = config.train.resume
    if mode == "never":
        listing = list_checkpoints(out)
        if listing.committed:
            raise ResumeError(
                f"train.resume is never but {out} already holds committed checkpoints "
                f"(latest {listing.latest.name}); use a new train.output_dir, delete them, "
                "or set train.resume: auto"
            )
        return None
    if mode != "auto":
        return _verified_checkpoint("train.resume", mode)
    listing = list_checkpoints(out)
    for _, path in listing.incomplete:
        _report(0, f"ignoring incomplete checkpoint {path} (no commit record: a save that never finished)")
    lineage = next((lineage_of(p) for _, p in reversed(listing.committed) if lineage_of(p)), None)
    for _, path in reversed(listing.committed):
        problems = checkpoint_problems(path)
        if not problems and lineage_of(path) == lineage:
            return path
        if not problems:
            _report(0, f"skipping checkpoint {path}: another lineage than the newest committed checkpoint's")
            continue
        message = f"checkpoint {path} does not verify:\n  - " + "\n  - ".join(problems)
        if config.train.resume_strict:
            raise ResumeError(message + "\n  train.resume_strict is set; repair or delete it, or unset resume_strict")
        _report(0, "skipping " + message)
    return None


def abandon_later(out: Path, resumed: Path, rank: int, world: int) -> None:
    """After resuming from `resumed`, move the committed checkpoints of later steps aside (another branch,
    or ones that did not verify): the run continues one lineage, and nothing committed is deleted."""
    if rank == 0:
        step = int(resumed.name.removeprefix("step-")) if resumed.name.startswith("step-") else None
        later = [p for s, p in list_checkpoints(out).committed if step is not None and s > step]
        aside = move_aside(out, later, f"after-resume-from-{resumed.name}")
        if aside is not None:
            names = ", ".join(p.name for p in later)
            _report(rank, f"resumed from {resumed.name}: the later checkpoints {names} are moved aside to {aside}")
    collectives.barrier()


def restore(parts: Checkpointable, ctx: RunContext, path: Path) -> dict:
    """Check identity (fail closed), then load model, optimizer, scheduler, loader, RNG and train state."""
    import torch.distributed.checkpoint as dcp

    try:
        state = read_state(path)
    except DocumentError as e:
        raise ResumeError(f"checkpoint {path}: {e}") from None
    mismatches, elastic = identity_mismatches(state["identity"], ctx.identity)
    if mismatches:
        raise ResumeError(
            f"checkpoint {path} was made by a different run; refusing to resume into it:\n  - "
            + "\n  - ".join(mismatches)
            + "\n  to proceed: restore the original settings; or start a new run (a new train.output_dir) from "
            f"these weights alone with --set train.weights_from={path}; or set train.resume: never in a new "
            "output directory"
        )
    for line in elastic:
        _report(ctx.rank, f"elastic resume ({line}): the same steps, re-dealt; not bitwise identical")
    try:
        tree = read_state_tree(path)
    except DocumentError as e:
        raise ResumeError(f"checkpoint {path}: {e}") from None
    tensors = _dcp_tensors(parts, parts.model.state_dict())  # the shapes and shards to load into
    try:
        with reading_tensors(path / DCP_DIR):
            dcp.load(tensors, storage_reader=safe_reader(path / DCP_DIR), no_dist=ctx.world == 1)
    except StateError as e:
        raise ResumeError(f"checkpoint {path}: {e}") from None
    parts.model.load_state_dict({"tensors": tensors, "tree": tree})
    if parts.reference is not None:
        parts.reference.load_state_dict(tensors["reference"])
    parts.scheduler.load_state_dict(state["scheduler_state"])
    saved_world = len(state["ranks"])
    source_rank = ctx.rank if saved_world == ctx.world else 0  # elastic: positions are equal on all ranks
    try:
        rank_state = read_rank_state(path / rank_files(source_rank)[0])
    except DocumentError as e:
        raise ResumeError(f"checkpoint {path}: {e}") from None
    recorded = state["ranks"][source_rank]["position"]
    if rank_state["loader"]["position"] != recorded:  # rank 0 verified this; a change since is refused
        raise ResumeError(
            f"checkpoint {path}: rank {source_rank}'s loader position {rank_state['loader']['position']} "
            f"differs from the one state.json records ({recorded})"
        )
    parts.loader.load_state_dict(rank_state["loader"])
    if saved_world == ctx.world:
        from safetensors.torch import load_file

        parts.rng.load_state_dict(load_file(str(path / rank_files(ctx.rank)[1])))
    parts.train.load_state_dict(
        {"step": state["step"], "consumed": state["consumed"], "early_stopping": state.get("early_stopping")}
    )
    return state


def load_weights(policy: Any, path: str) -> None:
    """train.weights_from: only the model weights of a committed, verified checkpoint, loaded into the
    unwrapped policy before the reference is copied from it (a new run: no identity check)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    directory = _verified_checkpoint("train.weights_from", path)
    state = {"model": get_model_state_dict(policy)}
    _check_weights_match(directory, path, state["model"])
    try:
        with reading_tensors(directory / DCP_DIR):
            dcp.load(state, storage_reader=safe_reader(directory / DCP_DIR), no_dist=True)
    except StateError as e:
        raise ResumeError(f"train.weights_from: {e}") from None
    set_model_state_dict(policy, state["model"])


def _check_weights_match(directory: Path, given: str, model_state: dict) -> None:
    """The checkpoint holds this model's whole weights: a LoRA run's checkpoint (adapters over a base) or
    another model's is named as such, not reported as damaged."""
    saved = {key.removeprefix("model.") for key in read_dcp_metadata(directory / DCP_DIR).state_dict_metadata}
    missing = sorted(set(model_state) - saved)
    if not missing:
        return
    if any(".lora_" in key for key in saved):
        raise ResumeError(
            f"train.weights_from {given}: {directory} is a LoRA run's checkpoint (adapters over a frozen base), "
            "and weights_from loads whole weights: resume that run instead (same train.output_dir, "
            "train.resume: auto), or start from its exported model (model.path: RUN/final-merged with "
            "train.export: both, or RUN/final with train.export: merged)"
        )
    raise ResumeError(
        f"train.weights_from {given}: {directory} holds another model's weights ({len(missing)} of this model's "
        f"tensors are not in it, e.g. {missing[0]}); set model.path / model.init to the model that run trained"
    )


def _verified_checkpoint(key: str, path: str) -> Path:
    """The checkpoint a setting names (a step or run directory), safe to read (`checkpoint_problems`)."""
    try:
        directory = resolve(path)
    except StateError as e:
        raise ResumeError(f"{key}: {e}") from None
    problems = checkpoint_problems(directory)
    if problems:
        raise ResumeError(f"{key}: checkpoint {directory} does not verify:\n  - " + "\n  - ".join(problems))
    return directory


# ---------------------------------------------------------------- collectives and hooks


def _agree(step: int) -> None:
    """Every rank is at `step`, else nothing is saved."""
    lo, hi = (int(x) for x in collectives.spread(torch.tensor([step], dtype=torch.int64)))
    if lo != hi:
        raise CheckpointError(f"ranks disagree on the step to save (steps {lo} to {hi}); nothing saved")


def kill_point(name: str) -> None:
    """SIGKILL this process group if `KILL_ENV` names this point (crash tests)."""
    if os.environ.get(KILL_ENV) == name:
        sys.stderr.flush()
        os.killpg(os.getpgid(0), signal.SIGKILL)


def _report(rank: int, message: str) -> None:
    if rank == 0:
        print(f"warning: {message}", file=sys.stderr, flush=True)
