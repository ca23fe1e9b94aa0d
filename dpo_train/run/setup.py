"""One run setup for training, precompute and held-out evaluation: the config checked, this rank placed and
joined, its sequence mesh, the run's tokenizer, and every dataset checked against them."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dpo_data.dataset.manifest import template_origin
from dpo_data.dataset.store import PairStore
from dpo_state.attestation import attestation_mismatch
from dpo_train.attention.sequence_parallel import SequenceMesh, run_mesh
from dpo_train.config.rules import check_config
from dpo_train.config.sections import TrainConfig
from dpo_train.errors import ConfigError
from dpo_train.model.policy import check_model_paths
from dpo_train.parallel.device import Placement, init_distributed, placement
from dpo_train.run.preflight import (
    apply_dataset_template,
    check_data,
    check_tokenizer,
    check_vocabulary,
    load_run_tokenizer,
)


@dataclass
class RunSetup:
    """Where this rank runs and what every dataset of the run is checked against."""

    config: TrainConfig
    place: Placement
    rank: int
    world: int
    mesh: SequenceMesh
    tokenizer: Any
    datasets: dict[str, PairStore] = field(default_factory=dict)
    """Config key (data.path, eval.path) -> its checked store."""

    def check_dataset(self, key: str, store: PairStore) -> PairStore:
        """Refuse a dataset whose shards differ from their manifests, built with another tokenizer than
        the run's, or than the run's other datasets (a random init has no tokenizer to compare)."""
        first = next(iter(self.datasets.items()), None)
        if first and store.tokenizer_fingerprint != first[1].tokenizer_fingerprint:
            raise ConfigError(_two_tokenizers(key, store, *first))
        check_data({key: store}, self.config.data.verify, self.rank, self.world)
        apply_dataset_template(self.tokenizer, self.config, key, store, self.rank)
        check_tokenizer(self.tokenizer, self.config, {key: store})
        self.datasets[key] = store
        return store

    def check_model(self, model: Any) -> None:
        """Refuse a model that cannot embed every token id of the run's datasets."""
        check_vocabulary(model, self.datasets)


def _two_tokenizers(key: str, store: PairStore, first_key: str, first: PairStore) -> str:
    mismatch = attestation_mismatch(
        first.tokenizer_attestation,
        store.tokenizer_attestation,
        f"{key} {', '.join(store.dirs)} was built with a tokenizer that",
        f"{first_key} {', '.join(first.dirs)}",
    )
    return (
        f"{mismatch}; {key}: {template_origin(store.chat_template)}, {first_key}: "
        f"{template_origin(first.chat_template)}. Fix: build both with the same tokenizer and the same "
        "--chat-template (or none)"
    )


def setup_run(config: TrainConfig) -> RunSetup:
    """Check the config and the model paths, place this rank, join the process group torchrun describes,
    and load the run's tokenizer: what training, precompute and evaluation all start from."""
    check_config(config)
    check_model_paths(config.model)
    place = placement(config.distributed.device, config.train.precision)
    rank, world = init_distributed(place)
    return RunSetup(config, place, rank, world, run_mesh(config, rank, world), load_run_tokenizer(config))
