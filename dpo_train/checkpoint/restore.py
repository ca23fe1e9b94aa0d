"""Resuming: which checkpoint to resume from, fail-closed restore of the `Checkpointable` parts, and
`train.weights_from`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpo_state.audit import checkpoint_problems
from dpo_state.dcp_io import (
    DCP_DIR,
    read_dcp_metadata,
    reading_tensors,
    safe_reader,
)
from dpo_state.errors import DocumentError, StateError
from dpo_state.layout import lineage_of, list_checkpoints, move_aside, resolve
from dpo_state.state import (
    differences,
    identity_mismatches,
    rank_files,
    read_rank_state,
    read_state,
    read_state_tree,
)
from dpo_train.checkpoint.parts import Checkpointable, RunView, dcp_tensors, warn
from dpo_train.config.sections import TrainConfig
from dpo_train.errors import ResumeError
from dpo_train.model.lora import run_environment
from dpo_train.parallel import collectives


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
        warn(0, f"ignoring incomplete checkpoint {path} (no commit record: a save that never finished)")
    lineage = next((lineage_of(p) for _, p in reversed(listing.committed) if lineage_of(p)), None)
    for _, path in reversed(listing.committed):
        problems = checkpoint_problems(path)
        if not problems and lineage_of(path) == lineage:
            return path
        if not problems:
            warn(0, f"skipping checkpoint {path}: another lineage than the newest committed checkpoint's")
            continue
        message = f"checkpoint {path} does not verify:\n  - " + "\n  - ".join(problems)
        if config.train.resume_strict:
            raise ResumeError(message + "\n  train.resume_strict is set; repair or delete it, or unset resume_strict")
        warn(0, "skipping " + message)
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
            warn(rank, f"resumed from {resumed.name}: the later checkpoints {names} are moved aside to {aside}")
    collectives.barrier()


def restore(parts: Checkpointable, run: RunView, identity: dict, path: Path) -> dict:
    """Check the checkpoint's identity against this run's `identity` (fail closed), then load model,
    optimizer, scheduler, loader, RNG and train state."""
    import torch.distributed.checkpoint as dcp

    try:
        state = read_state(path)
    except DocumentError as e:
        raise ResumeError(f"checkpoint {path}: {e}") from None
    mismatches, elastic = identity_mismatches(state["identity"], identity)
    if mismatches:
        raise ResumeError(
            f"checkpoint {path} was made by a different run; refusing to resume into it:\n  - "
            + "\n  - ".join(mismatches)
            + "\n  to proceed: restore the original settings; or start a new run (a new train.output_dir) from "
            f"these weights alone with --set train.weights_from={path}; or set train.resume: never in a new "
            "output directory"
        )
    for line in elastic:
        warn(run.rank, f"elastic resume ({line}): the same steps; not bitwise identical")
    _say_releases(state, run)
    try:
        tree = read_state_tree(path)
    except DocumentError as e:
        raise ResumeError(f"checkpoint {path}: {e}") from None
    tensors = dcp_tensors(parts, parts.model.state_dict())  # the shapes and shards to load into
    try:
        with reading_tensors(path / DCP_DIR):
            dcp.load(tensors, storage_reader=safe_reader(path / DCP_DIR), no_dist=run.world == 1)
    except StateError as e:
        raise ResumeError(f"checkpoint {path}: {e}") from None
    parts.model.load_state_dict({"tensors": tensors, "tree": tree})
    if parts.reference is not None:
        parts.reference.load_state_dict(tensors["reference"])
    parts.scheduler.load_state_dict(state["scheduler_state"])
    saved_world = len(state["ranks"])
    source_rank = run.rank if saved_world == run.world else 0  # elastic: positions are equal on all ranks
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
    if saved_world == run.world:
        from safetensors.torch import load_file

        parts.rng.load_state_dict(load_file(str(path / rank_files(run.rank)[1])))
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


def _say_releases(state: dict, run: RunView) -> None:
    """Each library whose release differs from the checkpoint's `environment` (absent before it was recorded:
    nothing to compare), said once: a resume may upgrade, but its steps are then not the first run's."""
    if "environment" not in state:
        return
    for name, was, now in differences(state["environment"], run_environment(run.config.model.lora)):
        warn(
            run.rank,
            f"resuming under another release (environment.{name}: checkpoint {was}, this run {now}): the same "
            "steps; their numbers may differ from the first run's",
        )
