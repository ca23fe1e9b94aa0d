"""The start-up checks that settle how a run's rows are scored (its `Scoring`): the packing probe (packed rows, or
auto's fallback to unpacked ones) and the chunked head's check (the logits budget, or the model's own head)."""

from __future__ import annotations

import dataclasses
from typing import Any

from dpo_data.progress import say
from dpo_train.attention.choice import taken
from dpo_train.config.sections import TrainConfig
from dpo_train.logps.head_check import check_head
from dpo_train.logps.head_check import note as head_note
from dpo_train.logps.probe import probe
from dpo_train.logps.scoring import Scoring
from dpo_train.logps.tiled_mlp import tiles_of
from dpo_train.parallel.device import Placement
from dpo_train.run.progress import stage
from dpo_train.vision.families import tower_of


def checked_scoring(model: Any, config: TrainConfig, place: Placement, unpacked: bool, shown: bool) -> Scoring:
    """The `Scoring` every forward of the run is passed, the reference's too: `unpacked` (`load_model`'s answer)
    unless the probe falls back, the model's MLP tiles, `train.compiled_head`, and `train.logits_budget_mib`
    where the chunked head stands in for the model's own (a note says why not). `shown`: say each stage."""
    if config.train.probe_packing:
        with stage("probe", shown):
            unpacked = probe(model, config.data.layout, config.model.attention, unpacked).unpacked
        if shown and tower_of(model) is not None:
            say(
                f"note: {type(model).__name__}: the start-up probe checked its decoder on packed text rows; rows "
                "with images are checked by step 1's parity guard on the run's own pairs (train.parity_guard) and "
                "by tests/vision (docs/vision.md)"
            )
    if shown:
        say(taken(model, config.model.attention, place, config.data.layout, unpacked))
    scoring = Scoring(unpacked, None, config.train.compiled_head, tiles_of(model))
    budget, why = config.train.logits_budget_mib, None
    if budget is not None:
        with stage("head", shown):
            why = check_head(model, scoring, config.data.layout)
    if why:
        head_note(model, why)
    if not why and budget is not None:
        scoring = dataclasses.replace(scoring, logits_budget=budget * 2**20)
    return scoring
