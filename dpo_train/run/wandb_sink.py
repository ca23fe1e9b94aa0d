"""The wandb sink (`train.report_to: [wandb]`): one W&B run per run directory, continued on resume."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import yaml

from dpo_state.files import read_document, write_json_atomic
from dpo_train.errors import ConfigError, WriteError
from dpo_train.run.directory import RESOLVED_CONFIG

RUN_FILE = "wandb-run.json"
"""OUTPUT/wandb-run.json: the W&B run id of this run directory, so that a resumed run continues that run."""
RUN_FILE_VERSION = 1
DEFAULT_PROJECT = "dpo-toolkit"


def wandb_root(out: Path) -> Path:
    """The directory wandb is given: WANDB_DIR when set, else OUTPUT; wandb writes into its `wandb/` folder."""
    return Path(os.environ.get("WANDB_DIR") or out)


def run_id(out: Path, resumed_at: int | None) -> str:
    """A resumed run keeps the id stored in OUTPUT; a fresh start (its logs replaced) gets a new one, as does
    a resume of a run that had no wandb run. WANDB_RUN_ID, when set, is the id either way."""
    path = out / RUN_FILE
    if resumed_at is not None and path.is_file() and not os.environ.get("WANDB_RUN_ID"):
        return read_document(path, "wandb-run", RUN_FILE_VERSION)["run_id"]
    chosen = os.environ.get("WANDB_RUN_ID") or secrets.token_hex(4)  # 8 characters, as wandb's own ids
    write_json_atomic(path, {"format_version": RUN_FILE_VERSION, "run_id": chosen}, schema="wandb-run")
    return chosen


class WandbRun:
    """Rank 0's W&B run: project WANDB_PROJECT (default dpo-toolkit), name WANDB_NAME (default OUTPUT's
    name), entity WANDB_ENTITY, mode WANDB_MODE (offline: files only), the resolved config as its config."""

    def __init__(self, out: Path, resumed_at: int | None):
        import wandb

        self._timed: tuple[int | None, float | None] = (None, None)  # the last step logged with its time
        config = yaml.safe_load((out / RESOLVED_CONFIG).read_text())  # written by rank 0 before the run opens
        try:
            self.run = wandb.init(
                project=os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
                name=os.environ.get("WANDB_NAME") or out.name,
                dir=str(wandb_root(out)),
                id=run_id(out, resumed_at),
                resume="allow",  # the id exists on the server only when this is a resume
                config=config,
            )
        except wandb.errors.Error as e:  # no API key, server unreachable, a bad WANDB_* value
            raise ConfigError(
                f"train.report_to: wandb could not start a run ({e}); log in (`wandb login` or WANDB_API_KEY), "
                "or set WANDB_MODE=offline to write the run under WANDB_DIR only (`wandb sync` uploads it later), "
                "or drop wandb from train.report_to"
            ) from None

    def write(self, scalars: dict, step: int, walltime: float | None) -> None:
        """One point per scalar at `step`; wandb merges the calls of one step into one row of its history."""
        import wandb

        row = {name: value for name, value in scalars.items() if value is not None}
        if walltime is None and step == self._timed[0]:
            walltime = self._timed[1]  # an evaluation joins its step's row: wandb would stamp the row anew
        if walltime is not None:
            row["_timestamp"], self._timed = walltime, (step, walltime)  # the step's time, as TensorBoard's
        try:
            self.run.log(row, step=step)
        except wandb.errors.Error as e:
            raise WriteError(f"train.report_to: wandb could not log step {step} ({e})") from None

    def close(self, failed: bool) -> None:
        self.run.finish(exit_code=1 if failed else 0)
