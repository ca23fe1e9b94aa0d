"""The run directory: never a dataset or a system directory, one run in it at a time, written from the start."""

from __future__ import annotations

import contextlib
import re
import socket
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import yaml

from dpo_data.dataset.manifest import MANIFEST_NAME, PART_NAME, STAGING_SUFFIX
from dpo_data.dataset.shards import SHARD_DIR
from dpo_state.lock import DirectoryLock
from dpo_train.config.sections import TrainConfig
from dpo_train.errors import ConfigError, WriteError
from dpo_train.parallel import collectives

SYSTEM_DIRS = ("/bin", "/boot", "/dev", "/etc", "/lib", "/lib32", "/lib64", "/proc", "/sbin", "/sys", "/usr")
"""A run never goes into these, nor is it the filesystem root or the home directory itself."""
SHARED_WAIT_S = 5.0
"""How long a rank looks for rank 0's marker: a network filesystem may show another machine's new file late."""
RESOLVED_CONFIG = "config.resolved.yaml"
STAGING = re.compile(".+" + STAGING_SUFFIX)
"""A build's or merge's staging directory (`dpo_data.prepare.output.new_staging`): the next build of its --out
deletes it."""


def check_output_dir(config: TrainConfig) -> Path:
    """`train.output_dir`, refused where a run would be lost or would damage something else."""
    given = config.train.output_dir
    out = Path(given).expanduser().resolve()
    field = f"train.output_dir {given!r}"
    if out == Path("/") or out == Path.home().resolve():
        raise ConfigError(f"{field} is {out}: a run needs a directory of its own; set e.g. runs/NAME")
    for system in map(Path, SYSTEM_DIRS):
        if out == system or system in out.parents:
            raise ConfigError(f"{field} lies in the system directory {system}; set a directory of your own")
    _check_datasets_apart(config, out, field)
    return out


def _check_datasets_apart(config: TrainConfig, out: Path, field: str) -> None:
    """`dpo-data build --overwrite` replaces a dataset directory whole: a run inside one would go with it."""
    named = [("data.path", p) for p in config.data.paths]
    named += [("eval.path", config.eval.path)] if config.eval.path else []
    for key, path in named:
        dataset = Path(path).expanduser().resolve()
        if out == dataset or dataset in out.parents:
            raise ConfigError(
                f"{field} lies inside the dataset {key} {path}; rebuilding that dataset (dpo-data build "
                "--overwrite) would delete the run: choose an output_dir outside every dataset"
            )
        if out in dataset.parents:
            raise ConfigError(
                f"{field} holds the dataset {key} {path}; a run directory holds only its run (deleting the run "
                "would delete the dataset): move the dataset out, or choose another output_dir"
            )
    for directory in (out, *out.parents):
        for marker, what in ((MANIFEST_NAME, "dataset"), (PART_NAME, "dataset part")):
            if (directory / marker).is_file() and (directory / SHARD_DIR).is_dir():
                raise ConfigError(
                    f"{field} is or lies inside the {what} at {directory} (it holds {marker} and {SHARD_DIR}/); "
                    f"rebuilding or deleting it would delete the run: choose an output_dir outside every {what}"
                )
        if STAGING.fullmatch(directory.name):
            raise ConfigError(
                f"{field} is or lies inside {directory}, named as a dpo-data build's staging directory "
                "(OUT.incomplete-XXXXXXXXXXXX), which the next build of OUT deletes: choose another output_dir"
            )


@contextlib.contextmanager
def run_lock(out: Path, rank: int) -> Iterator[None]:
    """Rank 0 holds `OUTPUT.lock` for the whole run: a second run into the same directory is refused,
    naming the first, instead of interleaving logs and moving the other's checkpoints aside."""
    if rank != 0:
        yield
        return
    lock = DirectoryLock(
        out,
        busy=f"train.output_dir {out} is in use by another run ({{holder}}, lock {{lock}}); wait for it to "
        "finish, or choose another train.output_dir",
        unwritable=f"train.output_dir {out}: cannot create the lock file {{lock}} ({{reason}}); choose a "
        "writable location",
        error=ConfigError,  # another run is the user's to sort out: exit 2
        unwritable_error=WriteError,
    )
    with lock:
        yield


def start_run_dir(out: Path, config: TrainConfig) -> None:
    """Create the run directory and write the resolved config; an unwritable place is a named error."""
    try:
        out.mkdir(parents=True, exist_ok=True)
        (out / RESOLVED_CONFIG).write_text(yaml.safe_dump(config.resolved(), sort_keys=False))
    except OSError as e:
        raise WriteError(
            f"train.output_dir {out} cannot be written ({e.strerror}: {e.filename}); choose a writable directory"
        ) from None


def check_shared(out: Path, rank: int, world: int) -> None:
    """Every rank sees rank 0's run directory at `out`: each rank writes its checkpoint shards there and a resume
    reads every shard back, so a directory on each machine's own disk (or a relative output_dir started from
    different working directories) would leave checkpoints that no run can resume, found only at the resume.
    Rank 0 writes a marker of a fresh name into it; every rank must read it."""
    if world == 1:
        return
    name = collectives.broadcast_from_rank0(f".every-rank-sees-{uuid.uuid4().hex}" if rank == 0 else None)
    marker = out / name
    if rank == 0:
        marker.write_text(name)
    collectives.barrier()
    where = collectives.gather_objects(f"{socket.gethostname()}:{out}")
    failures = collectives.gather_failures("" if _sees(marker, name) else f"rank {rank} ({where[rank]})")
    collectives.barrier()  # every rank has looked before the marker goes
    if rank == 0:
        marker.unlink(missing_ok=True)
    if failures:
        raise ConfigError(
            f"train.output_dir is not one directory for every rank: {', '.join(failures)} cannot see the file rank 0 "
            f"wrote into {where[0]} within {SHARED_WAIT_S:.0f} s. Every rank writes its checkpoint shards there and a "
            "resume reads all of them, so the checkpoints could never be resumed. Fix: an absolute output_dir on a "
            "filesystem every machine mounts at the same path"
        )


def _sees(marker: Path, name: str) -> bool:
    deadline = time.monotonic() + SHARED_WAIT_S
    while True:
        with contextlib.suppress(OSError, UnicodeDecodeError):
            if marker.read_text() == name:
                return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)


def resume_hint(output_dir: str | Path) -> str:
    """What an interrupted run left to resume from, and how."""
    from dpo_state.layout import list_checkpoints

    latest = list_checkpoints(output_dir).latest
    if latest is None:
        return f"no checkpoint was committed in {output_dir} (train.save_every sets how often); a rerun starts over"
    return f"the last committed checkpoint is {latest}; rerun the same command to resume from it"
