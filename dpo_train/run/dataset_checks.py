"""The datasets a run reads, checked: each against its manifests, against the run's first dataset's tokenizer, and
against the run's tokenizer (with the dataset's chat template applied) or, for vision data, the model's processor."""

from __future__ import annotations

from typing import Any

from dpo_data.dataset.manifest import template_origin
from dpo_data.dataset.store import PairStore
from dpo_data.loading.images import ImageSource
from dpo_state.attestation import attestation_mismatch
from dpo_train.config.sections import TrainConfig
from dpo_train.errors import ConfigError
from dpo_train.run.preflight import apply_dataset_template, check_data, check_tokenizer


def check_datasets(
    config: TrainConfig, tokenizer: Any, rank: int, world: int, data: PairStore, held_out: PairStore | None
) -> None:
    """Refuse a dataset whose shards differ from their manifests, built with another tokenizer than the run's,
    or than the run's other dataset (a random init has no tokenizer to compare); a vision dataset built with
    another processor than the model's (`dpo_data.loading.images.ImageSource`, which loads it once)."""
    for key, store in named(data, held_out).items():
        if store.tokenizer_fingerprint != data.tokenizer_fingerprint:
            raise ConfigError(_two_tokenizers(key, store, "data.path", data))
        check_data({key: store}, config.data.verify, rank, world)
        if store.vision:  # its processor's attestation holds the tokenizer's: compared by the loader's ImageSource
            ImageSource(config.model.processor, store)
            continue
        apply_dataset_template(tokenizer, config, key, store, rank)
        check_tokenizer(tokenizer, config, {key: store})


def named(data: PairStore, held_out: PairStore | None) -> dict[str, PairStore]:
    """Config key -> its store, as errors name them."""
    return {"data.path": data, **({"eval.path": held_out} if held_out is not None else {})}


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
