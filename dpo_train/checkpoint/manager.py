"""A run's checkpoints: where it resumes from, when it saves, and the lineage every save records."""

from __future__ import annotations

from dpo_data.progress import Stage
from dpo_state.layout import step_dir
from dpo_train.checkpoint.parts import Checkpointable, RunView, new_lineage
from dpo_train.checkpoint.restore import abandon_later, find_resume, restore
from dpo_train.checkpoint.save import save
from dpo_train.errors import CheckpointError


class Checkpoints:
    """The one owner of a run's checkpoints: it finds the checkpoint to resume from (`train.resume`), restores it
    and abandons the ones after it, saves every `train.save_every` steps and at the end, and carries the lineage
    (run id, parent checkpoint, where the run resumed from) from one save to the next."""

    def __init__(self, run: RunView, parts: Checkpointable, identity: dict):
        """`identity`: what a checkpoint of this run records and a resume must share (`checkpoint.identity`)."""
        self.run, self.parts, self.identity = run, parts, identity
        self.every = run.config.train.save_every
        self.lineage = new_lineage()
        self.resume_from = find_resume(run.config, run.out, run.rank)
        """The checkpoint this run continues, or None for a fresh start; found before the first step."""
        self.resumed_at: int | None = None
        """The step the run resumed at, or None for a fresh start."""
        self._saved_step = 0
        self._verify = run.config.train.read_back
        """This process's first save is read back before it is committed (a resumed run's too)."""

    def resume(self) -> None:
        """Load the checkpoint found at construction into the run's parts (nothing on a fresh start)."""
        if self.resume_from is None:
            return
        state = restore(self.parts, self.run, self.identity, self.resume_from)
        abandon_later(self.run.out, self.resume_from, self.run.rank, self.run.world)
        self.lineage = {**state["lineage"], "parent": self.resume_from.name, "resumed_from": str(self.resume_from)}
        self.resumed_at = self._saved_step = self.parts.train.step

    def after_step(self, done: bool) -> None:
        """Save when the step just taken is on the cadence, or is the run's last."""
        step = self.parts.train.step
        if self.every and (step % self.every == 0 or done):
            self._save()

    def finish(self) -> None:
        """Save the last step when the data ran out before `max_steps`, off the cadence."""
        if self.every and self.parts.train.step != self._saved_step:
            self._save()

    def keep_trained(self) -> str:
        """Save the last step when no checkpoint holds it (whatever `train.save_every` says): what an export that
        failed would lose; where it is, as a sentence (or, when that save fails too, that it is lost and why)."""
        step = self.parts.train.step
        if step != self._saved_step:
            try:
                self._save()
            except CheckpointError as e:  # (on every rank alike: a failed save is agreed on before it raises)
                return f"The trained weights of step {step} could not be kept in a checkpoint either: {e}"
        directory = step_dir(self.run.out, step)
        return (
            f"The trained weights of step {step} are in the committed checkpoint {directory}; "
            "rerunning the same command after the fix resumes from it and exports again"
        )

    def _save(self) -> None:
        with Stage(f"checkpoint at step {self.parts.train.step}", enabled=self.run.shown):
            directory = save(self.parts, self.run, self.identity, self.lineage, verify=self._verify)
        self._verify = False
        self.lineage = {**self.lineage, "parent": directory.name}
        self._saved_step = self.parts.train.step
