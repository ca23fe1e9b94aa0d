"""Fault injection for the crash and abort tests: every testing hook read from the environment, one function each.

Production code calls these by name where a fault may be injected; nothing else reads the variables.
Unset (the normal case), each function does nothing.

- `DPO_TRAIN_KILL` (`train_kill_point`): `after-save:STEP`, `in-save:STEP:PHASE` (PHASE: `after-dcp`,
  `after-rank-files`, `after-state`, `after-commit`) or `in-export:NAME` (`in-export:final`) SIGKILLs the
  trainer's process group there.
- `DPO_TRAIN_INTERRUPT` (`train_kill_point` too): points of the same names, comma-separated, each send this
  process a SIGINT there, as a Ctrl-C does (the interrupt tests).
- `DPO_TRAIN_SAVE_FAULT` (`save_fault`, `commit_fault`): `RANK:STEP` makes that rank's save of that step
  raise an OSError (abort-on-all tests); `commit:STEP` makes rank 0's commit of that step raise one;
  `flip:RANK:STEP` (`flip_written`) flips one bit in the middle of that rank's largest DCP file of that step
  once DCP has written it, as a filesystem that does not return what was written would (read-back tests).
- `DPO_TRAIN_EXPORT_FAULT` (`flip_exported`): `flip` flips one bit in the middle of the export's largest weights
  file once it is written, before it is read back (export read-back tests).
- `DPO_TRAIN_FAULT` (`step_fault`): `RANK:STEP` makes that rank fail reading that training step (an OSError).
- `DPO_DATA_KILL` (`data_kill_point`): `before-swap`, `after-swap` or `after-delete` SIGKILLs the build
  process there.
- `DPO_DATA_STOP` (`data_kill_point` too): a point of the same names SIGSTOPs the build process there, until a
  SIGCONT (a test changes the disk under a build at a known moment: remounts it read-only).
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable
from pathlib import Path

TRAIN_KILL_ENV = "DPO_TRAIN_KILL"
TRAIN_INTERRUPT_ENV = "DPO_TRAIN_INTERRUPT"
SAVE_FAULT_ENV = "DPO_TRAIN_SAVE_FAULT"
EXPORT_FAULT_ENV = "DPO_TRAIN_EXPORT_FAULT"
STEP_FAULT_ENV = "DPO_TRAIN_FAULT"
DATA_KILL_ENV = "DPO_DATA_KILL"
DATA_STOP_ENV = "DPO_DATA_STOP"


def train_kill_point(name: str) -> None:
    """SIGKILL this process group if `DPO_TRAIN_KILL` names this point; SIGINT this process if
    `DPO_TRAIN_INTERRUPT` lists it."""
    if os.environ.get(TRAIN_KILL_ENV) == name:
        sys.stderr.flush()
        os.killpg(os.getpgid(0), signal.SIGKILL)
    if name in os.environ.get(TRAIN_INTERRUPT_ENV, "").split(","):
        os.kill(os.getpid(), signal.SIGINT)


def save_fault(rank: int, step: int) -> None:
    """Raise an OSError if `DPO_TRAIN_SAVE_FAULT` is RANK:STEP for this rank's save of this step."""
    if os.environ.get(SAVE_FAULT_ENV) == f"{rank}:{step}":
        raise OSError(f"injected save fault ({SAVE_FAULT_ENV}) on rank {rank}")


def flip_written(rank: int, step: int, dcp_dir: str | Path) -> None:
    """Flip one bit in the middle of this rank's largest DCP data file if `DPO_TRAIN_SAVE_FAULT` is
    flip:RANK:STEP for this rank's save of this step (DCP names a rank's files __RANK_N.distcp)."""
    if os.environ.get(SAVE_FAULT_ENV) == f"flip:{rank}:{step}":
        _flip_middle(max(Path(dcp_dir).glob(f"__{rank}_*.distcp"), key=lambda f: f.stat().st_size))


def flip_exported(staging: str | Path) -> None:
    """Flip one bit in the middle of an export's largest weights file if `DPO_TRAIN_EXPORT_FAULT` is flip."""
    if os.environ.get(EXPORT_FAULT_ENV) == "flip":
        _flip_middle(max(Path(staging).glob("*.safetensors"), key=lambda f: f.stat().st_size))


def _flip_middle(path: Path) -> None:
    with open(path, "r+b") as f:
        f.seek(path.stat().st_size // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0x10]))


def commit_fault(step: int) -> None:
    """Raise an OSError if `DPO_TRAIN_SAVE_FAULT` is commit:STEP for rank 0's commit of this step."""
    if os.environ.get(SAVE_FAULT_ENV) == f"commit:{step}":
        raise OSError(f"injected commit fault ({SAVE_FAULT_ENV})")


def step_fault(rank: int) -> Callable[[int], None]:
    """The check a rank runs before reading each step: raises where `DPO_TRAIN_FAULT` is RANK:STEP."""
    spec = os.environ.get(STEP_FAULT_ENV, "")
    if not spec:
        return lambda step: None
    fault_rank, fault_step = (int(x) for x in spec.split(":"))

    def check(step: int) -> None:
        if rank == fault_rank and step == fault_step:
            raise OSError(f"injected fault ({STEP_FAULT_ENV}={spec}): rank {rank} failed reading step {step}")

    return check


def data_kill_point(name: str) -> None:
    """SIGKILL this process if `DPO_DATA_KILL` names this point; SIGSTOP it if `DPO_DATA_STOP` does."""
    if os.environ.get(DATA_KILL_ENV) == name:
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
    if os.environ.get(DATA_STOP_ENV) == name:
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGSTOP)
