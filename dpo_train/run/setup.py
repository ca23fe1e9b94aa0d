"""The one run object: what setup resolves for this rank (the checked config, placement, mesh, tokenizer and
datasets; for training also the output directory under its lock, the sinks and the loader's plan), handed to
training, precompute and held-out evaluation alike. Nothing after setup changes it."""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dpo_data.dataset.manifest import template_origin
from dpo_data.dataset.store import PairStore
from dpo_data.loading.config import LoaderConfig
from dpo_data.loading.images import ImageSource
from dpo_data.loading.loader import DPOLoader
from dpo_state.attestation import attestation_mismatch
from dpo_train.attention.sequence_parallel import SequenceMesh, run_mesh
from dpo_train.config.rules import check_config
from dpo_train.config.sections import TrainConfig
from dpo_train.errors import ConfigError
from dpo_train.model.policy import check_model_paths
from dpo_train.parallel.device import Placement, init_distributed, placement
from dpo_train.run.agreement import check_ranks_agree
from dpo_train.run.directory import check_output_dir, check_shared, run_lock, start_run_dir
from dpo_train.run.environment import set_run_environment
from dpo_train.run.inputs import check_inputs
from dpo_train.run.preflight import (
    apply_dataset_template,
    check_data,
    check_sees_images,
    check_tokenizer,
    check_vocabulary,
    load_run_tokenizer,
)
from dpo_train.run.progress import datasets, stage
from dpo_train.run.sinks import check_report_to, check_sinks


@dataclass(frozen=True)
class Run:
    """One rank's run as setup resolved it: the entry points get theirs from `training_run` or `precompute_run`,
    a loop of the caller's own from `local_run`."""

    config: TrainConfig
    """Checked; a run set by epochs (`train.max_steps: null`) has its step count here, from the loader's plan."""
    place: Placement
    rank: int
    world: int
    mesh: SequenceMesh
    data: PairStore
    """data.path, checked against its manifests and the run's tokenizer."""
    held_out: PairStore | None = None
    """eval.path, checked like data.path; None without one."""
    tokenizer: Any = None
    """The run's tokenizer, with a dataset's attested chat template applied; None for a random init."""
    out: Path | None = None
    """The output directory, locked by rank 0 while the run holds it (training only)."""
    loader: DPOLoader | None = None
    """The training data's loader, asked for this rank's data-parallel share (training only)."""
    shown: bool = False
    """This rank says what long stages do (rank 0, unless --quiet)."""

    @property
    def geometry(self) -> LoaderConfig:
        """This rank's loader config: its data-parallel share (a sequence-parallel group shares its rows)."""
        return _geometry(self.config, self.mesh)

    def check_model(self, model: Any) -> None:
        """Refuse a model that cannot embed every token id of the run's datasets, or that cannot see the images
        a vision dataset holds."""
        check_vocabulary(model, _named(self.data, self.held_out))
        check_sees_images(model, _named(self.data, self.held_out))


@contextlib.contextmanager
def training_run(config: TrainConfig, progress: bool = True) -> Iterator[Run]:
    """The run `dpo-train` trains: set up, its output directory started and locked for the whole run (rank 0),
    its sinks checked, the loader's plan read and every dataset checked."""
    config, place, rank, world, mesh, tokenizer = _placed(config, progress)
    check_report_to(config.train.report_to)
    out = check_output_dir(config)
    shown = progress and rank == 0
    with run_lock(out, rank):
        if rank == 0:
            start_run_dir(out, config)
            check_sinks(config.train.report_to, out)
        check_shared(out, rank, world)
        with stage("datasets", shown, datasets=_count(config)):
            loader = DPOLoader(
                config.data.paths,
                _geometry(config, mesh),
                max_epochs=None if config.train.max_steps is not None else config.train.epochs,
                pad_to_multiple_of=8,
                processor=config.model.processor,  # a vision dataset's images: prepared by the model's processor
            )
            config = _with_total_steps(config, loader)
            held_out = PairStore([config.eval.path]) if config.eval.path else None
            _check_datasets(config, tokenizer, rank, world, loader.stream.store, held_out)
        yield Run(config, place, rank, world, mesh, loader.stream.store, held_out, tokenizer, out, loader, shown)


def precompute_run(config: TrainConfig, progress: bool = True) -> Run:
    """The run `--precompute-reference` scores: set up, with data.path checked (it writes no run directory)."""
    config, place, rank, world, mesh, tokenizer = _placed(config, progress, precompute=True)
    shown = progress and rank == 0
    with stage("datasets", shown, datasets=datasets(len(config.data.paths))):
        data = PairStore(config.data.paths)
        _check_datasets(config, tokenizer, rank, world, data, None)
    return Run(config, place, rank, world, mesh, data, tokenizer=tokenizer, shown=shown)


def local_run(
    config: TrainConfig, place: Placement, data: PairStore, *, rank: int = 0, world: int = 1, out: Path | None = None
) -> Run:
    """A run for a `Trainer` driven by the caller's own loop (tests, benchmarks, another trainer's harness): no
    process group joined (a `world` > 1 is the caller's), no directory locked, no dataset checked; the caller
    answers for those. Its mesh is the config's, as `training_run` builds it."""
    return Run(config, place, rank, world, run_mesh(config, rank, world), data, out=out)


def _placed(
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


def _count(config: TrainConfig) -> str:
    """The datasets a training run verifies: data.path's directories and eval.path."""
    return datasets(len(config.data.paths) + bool(config.eval.path))


def _geometry(config: TrainConfig, mesh: SequenceMesh) -> LoaderConfig:
    return config.data.loader_config(mesh.dp_rank, mesh.dp_size)


def _with_total_steps(config: TrainConfig, loader: DPOLoader) -> TrainConfig:
    """`train.max_steps` wins when set, as TRL's does; `max_steps: null` trains `train.epochs` epochs, whose
    steps are counted from the loader's own plan (the scheduler and the progress line need the total)."""
    if config.train.max_steps is not None:
        return config
    total = loader.stream.schedule.steps_in(config.train.epochs)
    return dataclasses.replace(config, train=dataclasses.replace(config.train, max_steps=total))


def _check_datasets(
    config: TrainConfig, tokenizer: Any, rank: int, world: int, data: PairStore, held_out: PairStore | None
) -> None:
    """Refuse a dataset whose shards differ from their manifests, built with another tokenizer than the run's,
    or than the run's other dataset (a random init has no tokenizer to compare); a vision dataset built with
    another processor than the model's (`dpo_data.loading.images.ImageSource`, which loads it once)."""
    for key, store in _named(data, held_out).items():
        if store.tokenizer_fingerprint != data.tokenizer_fingerprint:
            raise ConfigError(_two_tokenizers(key, store, "data.path", data))
        check_data({key: store}, config.data.verify, rank, world)
        if store.vision:  # its processor's attestation holds the tokenizer's: compared by the loader's ImageSource
            ImageSource(config.model.processor, store)
            continue
        apply_dataset_template(tokenizer, config, key, store, rank)
        check_tokenizer(tokenizer, config, {key: store})


def _named(data: PairStore, held_out: PairStore | None) -> dict[str, PairStore]:
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
