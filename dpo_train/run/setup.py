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

from dpo_data.dataset.store import PairStore
from dpo_data.loading.config import LoaderConfig
from dpo_data.loading.images import ImageSource
from dpo_data.loading.loader import DPOLoader
from dpo_train.attention.sequence_parallel import SequenceMesh, run_mesh
from dpo_train.config.sections import TrainConfig
from dpo_train.parallel.device import Placement
from dpo_train.run.dataset_checks import check_datasets, named
from dpo_train.run.directory import check_output_dir, check_shared, run_lock, start_run_dir
from dpo_train.run.preflight import check_sees_images, check_vocabulary
from dpo_train.run.progress import datasets, stage
from dpo_train.run.sinks import check_report_to, check_sinks
from dpo_train.run.start import placed


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
        check_vocabulary(model, named(self.data, self.held_out))
        check_sees_images(model, named(self.data, self.held_out))

    def processor(self) -> Any:
        """A vision-language run's processor, as the loader prepares its images with it (checked against the data's
        attestation): `final/` saves it. None for text data."""
        if not self.data.vision:
            return None
        return ImageSource(self.config.model.processor, self.data).prepared[0]


@contextlib.contextmanager
def training_run(config: TrainConfig, progress: bool = True) -> Iterator[Run]:
    """The run `dpo-train` trains: set up, its output directory started and locked for the whole run (rank 0),
    its sinks checked, the loader's plan read and every dataset checked."""
    config, place, rank, world, mesh, tokenizer = placed(config, progress)
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
            check_datasets(config, tokenizer, rank, world, loader.stream.store, held_out)
        yield Run(config, place, rank, world, mesh, loader.stream.store, held_out, tokenizer, out, loader, shown)


def precompute_run(config: TrainConfig, progress: bool = True) -> Run:
    """The run `--precompute-reference` scores: set up, with data.path checked (it writes no run directory)."""
    config, place, rank, world, mesh, tokenizer = placed(config, progress, precompute=True)
    shown = progress and rank == 0
    with stage("datasets", shown, datasets=datasets(len(config.data.paths))):
        data = PairStore(config.data.paths)
        check_datasets(config, tokenizer, rank, world, data, None)
    return Run(config, place, rank, world, mesh, data, tokenizer=tokenizer, shown=shown)


def local_run(
    config: TrainConfig, place: Placement, data: PairStore, *, rank: int = 0, world: int = 1, out: Path | None = None
) -> Run:
    """A run for a `Trainer` driven by the caller's own loop (tests, benchmarks, another trainer's harness): no
    process group joined (a `world` > 1 is the caller's), no directory locked, no dataset checked; the caller
    answers for those. Its mesh is the config's, as `training_run` builds it."""
    return Run(config, place, rank, world, run_mesh(config, rank, world), data, out=out)


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
