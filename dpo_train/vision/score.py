"""Per-pair log-probs of a packed vision-language row, through the logps room's packed path and head."""

from __future__ import annotations

from typing import Any

from dpo_train.attention.features import model_config
from dpo_train.errors import ConfigError
from dpo_train.logps.pairs import PairLogps, pair_logps
from dpo_train.logps.scoring import Scoring
from dpo_train.vision.families import family_of


def vision_pair_logps(model: Any, batch: dict[str, Any], scoring: Scoring, **options: Any) -> PairLogps:
    """`pair_logps` of a row made by `rows.pack_vision`: the model embeds the row's images where its
    placeholders stand, reads `model_position_ids` where the row has them, and attends segment by segment
    (or with the row's masks under sdpa and eager), so each pair's sums equal its sequences run alone, scored as
    the run's `scoring` says.
    `options`: those of `pair_logps` (`ld_alpha`, `weighting`). Refused by name: a family the packed path
    cannot express (`families.family_of`), the unpacked path (which would run the sequences without their
    images) and sequence parallelism (which would split an image's tokens over ranks)."""
    family_of(model_config(model))
    if scoring.unpacked:
        raise ConfigError(
            "model.attention unpacked cannot score vision-language rows (it would run each sequence without its "
            "images); use model.attention auto, segments, sdpa or eager"
        )
    if options.get("mesh") is not None and options["mesh"].active:
        raise ConfigError(
            "distributed.sequence_parallel cannot score vision-language rows yet (an image's tokens would be split "
            "over ranks); remove it (data parallelism and FSDP still apply)"
        )
    return pair_logps(model, batch, scoring, **options)
