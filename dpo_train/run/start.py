"""Where every run starts: its process environment set, the config and its inputs checked, this rank placed and in
the process group, every rank's code, releases and config agreed, the run's tokenizer loaded."""

from __future__ import annotations

from typing import Any

from dpo_train.attention.sequence_parallel import SequenceMesh, run_mesh
from dpo_train.config.rules import check_config
from dpo_train.config.sections import TrainConfig
from dpo_train.model.policy import check_model_paths
from dpo_train.parallel.device import Placement, init_distributed, placement
from dpo_train.run.agreement import check_ranks_agree
from dpo_train.run.environment import set_run_environment
from dpo_train.run.inputs import check_inputs
from dpo_train.run.preflight import load_run_tokenizer
from dpo_train.run.progress import stage


def placed(
    config: TrainConfig, progress: bool, precompute: bool = False
) -> tuple[TrainConfig, Placement, int, int, SequenceMesh, Any]:
    """Check the config, its input directories and the model paths, place this rank, join the process group
    torchrun describes, check that every rank runs the same code and releases, and load the run's tokenizer: where
    every run starts (its process environment first, before anything large is allocated or any model loads, and
    before the output directory is created)."""
    set_run_environment()
    check_config(config)
    check_inputs(config.resolved(), precompute)
    check_model_paths(config.model)
    place = placement(config.distributed.device, config.train.precision)
    rank, world = init_distributed(place)
    check_ranks_agree(config, world)
    with stage("tokenizer", progress and rank == 0 and bool(config.model.tokenizer or config.model.path)):
        tokenizer = load_run_tokenizer(config)
    return config, place, rank, world, run_mesh(config, rank, world), tokenizer
