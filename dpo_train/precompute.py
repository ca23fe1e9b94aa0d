"""`dpo-train CONFIG --precompute-reference`: score every training pair with the reference once, into a sidecar."""

from __future__ import annotations

from pathlib import Path

from dpo_data.dataset.store import PairStore
from dpo_train import collectives
from dpo_train.attention.sequence_parallel import run_mesh
from dpo_train.config import TrainConfig
from dpo_train.device import init_distributed, placement
from dpo_train.errors import ConfigError
from dpo_train.initial_policy import initial_policy
from dpo_train.model import check_model_paths
from dpo_train.preflight import check_data, check_tokenizer, check_vocabulary, load_run_tokenizer
from dpo_train.reference import SIDECAR_DOCUMENT, write_sidecar
from dpo_train.scoring import score_pairs


def precompute_reference(config: TrainConfig, overwrite: bool = False) -> Path:
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
    check_model_paths(config.model)
    place = placement(config.distributed.device, config.train.precision)
    rank, world = init_distributed(place)
    store = PairStore(config.data.paths)
    check_data({"data.path": store}, config.data.verify, rank, world)
    check_tokenizer(load_run_tokenizer(config), config, {"data.path": store})
    mesh = run_mesh(config, rank, world)
    model, weights = initial_policy(config, place, mesh)  # the trainer's own: weights_from included
    check_vocabulary(model, {"data.path": store})
    model.to(place.device)
    layout = config.data.layout
    scores = score_pairs(model, store, config.data.max_tokens_per_microbatch, place.autocast, mesh, layout)
    path = Path(config.reference.path)
    if rank == 0:
        write_sidecar(path, scores, store, weights, place.precision, layout, config.model.path or "init")
    collectives.barrier()
    return path
