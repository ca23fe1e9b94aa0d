"""`dpo-train CONFIG --precompute-reference`: score every training pair with the reference once, into a sidecar."""

from __future__ import annotations

from pathlib import Path

from dpo_data.dataset.store import PairStore
from dpo_train.config.sections import TrainConfig
from dpo_train.errors import ConfigError
from dpo_train.parallel import collectives
from dpo_train.reference.scoring import score_pairs
from dpo_train.reference.sidecar import SIDECAR_DOCUMENT, write_sidecar
from dpo_train.run.initial_policy import initial_policy
from dpo_train.run.setup import setup_run


def precompute_reference(config: TrainConfig, overwrite: bool = False, progress: bool = True) -> Path:
    """Write the sidecar at `reference.path` for `data.path` and the initial policy (= the reference).

    Under torchrun every rank scores its share of the packed micro-batches; rank 0 writes. An existing
    sidecar is replaced only with `overwrite` (a run may be bound to it).
    """
    if not config.reference.path:
        raise ConfigError("--precompute-reference needs reference.path: the sidecar directory to write")
    existing = Path(config.reference.path) / SIDECAR_DOCUMENT
    if existing.is_file() and not overwrite:
        raise ConfigError(
            f"reference.path {config.reference.path} already holds a sidecar ({existing.name}); a run may be "
            "bound to it. Pass --overwrite to replace it, or set reference.path to a new directory"
        )
    setup = setup_run(config)
    store = setup.check_dataset("data.path", PairStore(config.data.paths))
    model, weights = initial_policy(config, setup.place, setup.mesh)  # the trainer's own: weights_from included
    setup.check_model(model)
    model.to(setup.place.device)
    layout, place = config.data.layout, setup.place
    shown = "precompute: the reference scores every training pair" if progress and setup.rank == 0 else None
    budget = config.data.max_tokens_per_microbatch
    scores = score_pairs(model, store, budget, place.autocast, setup.mesh, layout, progress=shown)
    path = Path(config.reference.path)
    if setup.rank == 0:
        write_sidecar(path, scores, store, weights, place.precision, layout, config.model.path or "init")
    collectives.barrier()
    return path
