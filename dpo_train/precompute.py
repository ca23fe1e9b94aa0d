"""`dpo-train CONFIG --precompute-reference`: score every training pair (or those the run reads) with the reference
once, into a sidecar."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from dpo_data.loading.steps import StepPlanner
from dpo_train.config import TrainConfig
from dpo_train.errors import ConfigError
from dpo_train.parallel import barrier
from dpo_train.reference import SIDECAR_DOCUMENT, score_pairs, write_sidecar
from dpo_train.run import alone_applies, load_initial_policy, precompute_check, precompute_run


def precompute_reference(
    config: TrainConfig, overwrite: bool = False, progress: bool = True, only_planned: bool = False
) -> Path:
    """Write the sidecar at `reference.path` for `data.path` and the initial policy (= the reference).

    Under torchrun every rank scores its share of the packed micro-batches; rank 0 writes. An existing
    sidecar is replaced only with `overwrite` (a run may be bound to it). With `only_planned`, only the pairs
    the config's steps read (the loader's plan) are scored, and the sidecar records that coverage.
    """
    started = time.perf_counter()  # the wall time the sidecar records: what a report adds to the run's
    if not config.reference.path:
        raise ConfigError("--precompute-reference needs reference.path: the sidecar directory to write")
    existing = Path(config.reference.path) / SIDECAR_DOCUMENT
    if existing.is_file() and not overwrite:
        raise ConfigError(
            f"reference.path {config.reference.path} already holds a sidecar ({existing.name}); a run may be "
            "bound to it. Pass --overwrite to replace it, or set reference.path to a new directory"
        )
    run = precompute_run(config, progress)
    store, place, layout = run.data, run.place, config.data.layout
    # the trainer's own policy, checkpointing included: `train.mlp_tile_tokens: auto` then tiles the same MLPs
    checkpointed = config.train.activation_checkpointing
    model, weights, scoring = load_initial_policy(config, place, run.mesh, checkpointed, shown=run.shown)
    run.check_model(model)
    model.to(place.device)
    steps, pairs = _planned(run) if only_planned else (None, None)
    what = "every training pair" if steps is None else f"the {len(pairs)} pairs of the run's {steps} steps"
    shown = f"precompute: the reference scores {what}" if run.shown else None
    budget = config.data.max_tokens_per_microbatch
    check = precompute_check(model, run, scoring) if alone_applies(config, model) else None
    scores = score_pairs(model, scoring, store, run, budget, progress=shown, pairs=pairs, check=check)
    path = Path(config.reference.path)
    if run.rank == 0:
        seconds = time.perf_counter() - started
        source = config.model.path or "init"
        write_sidecar(path, scores, store, weights, place.precision, layout, source, seconds, steps)
    barrier()
    return path


def _planned(run) -> tuple[int, np.ndarray]:
    """The run's step count (train.max_steps, or its epochs' steps) and the pairs those steps read, planned from
    lengths exactly as the trainer's loader plans them."""
    store, config = run.data, run.config
    lengths = store.segment_tokens(np.arange(store.num_pairs), config.data.layout)
    planner = StepPlanner(lengths, store.dataset_sizes, store.fingerprint, run.geometry)
    steps = config.train.max_steps
    if steps is None:
        steps = planner.steps_in(config.train.epochs)
    return steps, planner.pairs_in(steps)
