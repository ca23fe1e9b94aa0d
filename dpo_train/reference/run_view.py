"""What the reference room reads of a run: a `dpo_train.run.setup.Run`, which it cannot import (the run room is
above it)."""

from __future__ import annotations

from typing import Protocol

from dpo_data.dataset.store import PairStore
from dpo_train.attention.sequence_parallel import SequenceMesh
from dpo_train.config.sections import TrainConfig
from dpo_train.parallel.device import Placement


class RunView(Protocol):
    """The config (reference mode and sync, the loss's `ld_alpha`, the data layout), where the rank runs, and the
    training data a precomputed table is bound to."""

    config: TrainConfig
    place: Placement
    world: int
    mesh: SequenceMesh
    data: PairStore
