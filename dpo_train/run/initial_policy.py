"""The initial policy, which is also the reference's weights: built one way for training and for precompute."""

from __future__ import annotations

from typing import Any

from dpo_data.progress import say
from dpo_train.attention.sequence_parallel import SequenceMesh, check_heads
from dpo_train.checkpoint.restore import load_weights
from dpo_train.config.sections import TrainConfig
from dpo_train.logps.scoring import Scoring
from dpo_train.logps.tiled_mlp import apply_setting
from dpo_train.model.load import load_model
from dpo_train.model.policy import freeze_vision_tower, prepare_for_training
from dpo_train.model.settings import check_settings
from dpo_train.parallel.device import Placement
from dpo_train.reference.sidecar import weights_fingerprint
from dpo_train.run.progress import stage
from dpo_train.run.scoring_checks import checked_scoring


def load_initial_policy(
    config: TrainConfig,
    place: Placement,
    mesh: SequenceMesh,
    activation_checkpointing: bool = False,
    shown: bool = False,
) -> tuple[Any, str, Scoring]:
    """The model as step 1 starts from it, on the CPU, its weights' fingerprint, and how its rows are scored (the
    `Scoring` every forward of the run is passed, the reference's too): loaded through the attention path,
    `train.weights_from` applied, dropout off, a vision-language model's vision tower frozen unless
    `model.train_vision_tower`, the packing probe passed, the chunked head checked where a logits budget is set.
    A sidecar precomputed from anything else would be bound to other weights and refused by the run. `shown`:
    say each stage (rank 0 unless --quiet)."""
    with stage("model", shown):
        model, unpacked = load_model(config.model, config.model.attention, place, mesh, config.data.layout)
        check_heads(model.config, mesh.ulysses)
        if config.train.weights_from:
            load_weights(model, config.train.weights_from)
        prepare_for_training(model, activation_checkpointing)
        kept = check_settings(model)  # what disable_dropout zeroed must be dropout, or comes back
        if shown and kept:
            say(
                f"note: {type(model).__name__}: {', '.join(kept)} kept as loaded: named like dropout, but its "
                "evaluation forward reads it (docs/train-config.md, Failures)"
            )
        said = apply_setting(model, config.train.mlp_tile_tokens, activation_checkpointing)
        if shown and said:
            say(said)
        if not config.model.train_vision_tower:
            freeze_vision_tower(model)
    scoring = checked_scoring(model, config, place, unpacked, shown)
    return model, weights_fingerprint(model), scoring
