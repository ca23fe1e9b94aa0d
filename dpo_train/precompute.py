"""`dpo-train CONFIG --precompute-reference`: score every training pair with the reference once, into a sidecar."""

from __future__ import annotations

import time
from pathlib import Path

from dpo_train.config import TrainConfig
from dpo_train.errors import ConfigError
from dpo_train.parallel import barrier
from dpo_train.reference import SIDECAR_DOCUMENT, score_pairs, write_sidecar
from dpo_train.run import load_initial_policy, precompute_run


def precompute_reference(config: TrainConfig, overwrite: bool = False, progress: bool = True) -> Path:
    """Write the sidecar at `reference.path` for `data.path` and the initial policy (= the reference).

    Under torchrun every rank scores its share of the packed micro-batches; rank 0 writes. An existing
    sidecar is replaced only with `overwrite` (a run may be bound to it).
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
    model, weights = load_initial_policy(config, place, run.mesh, shown=run.shown)  # the trainer's own
    run.check_model(model)
    model.to(place.device)
    shown = "precompute: the reference scores every training pair" if run.shown else None
    budget = config.data.max_tokens_per_microbatch
    scores = score_pairs(model, store, run, budget, progress=shown)
    path = Path(config.reference.path)
    if run.rank == 0:
        seconds = time.perf_counter() - started
        write_sidecar(path, scores, store, weights, place.precision, layout, config.model.path or "init", seconds)
    barrier()
    return path
