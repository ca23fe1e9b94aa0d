"""Which reference a run's loss sees (live, LoRA adapters off, a precomputed sidecar, or none), behind one object."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dpo_data.loading.microbatch import MicroBatch
from dpo_train.config.sections import TrainConfig
from dpo_train.logps.pairs import pair_logps
from dpo_train.logps.scoring import Scoring
from dpo_train.parallel.device import Placement
from dpo_train.reference.guard import check_parity, reordered
from dpo_train.reference.live import AdaptersDisabled, frozen_reference, mix_into
from dpo_train.reference.run_view import RunView
from dpo_train.reference.sidecar import ReferenceTable, load_sidecar


@dataclass(frozen=True)
class ReferenceLogps:
    """The reference's log-probs of a micro-batch's pairs, as the loss reads them (`dpo_train.step.loss.Scored`)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    """[pairs] each: the summed completion log-probs (LD-DPO's sums with `ld_alpha`), without gradient."""

    @property
    def scored(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.chosen, self.rejected


def reference_mode(config: TrainConfig) -> str:
    """What the loss compares against: none for a reference-free loss, else `reference.mode`."""
    return config.reference.mode if config.loss.needs_reference else "none"


@dataclass
class Reference:
    """The reference's log-probs of a micro-batch's pairs, however this run gets them.

    `initial` is the frozen initial policy where the run keeps one: the live reference, and held-out
    evaluation's baseline (whatever the mode). With TR-DPO (`sync_steps`) the live copy moves toward the
    policy during training; evaluation scores its baseline before the first step (and before a resume
    loads the moved weights), so that stays the initial policy."""

    mode: str
    place: Placement
    mesh: Any
    initial: Any = None
    table: ReferenceTable | None = None
    ld_alpha: float | None = None
    """loss.ld_alpha: the live reference's sums are LD-DPO's, as the policy's (a sidecar is refused with it)."""
    sync_steps: int = 0
    """TR-DPO: reference.ref_model_sync_steps when reference.sync_ref_model is on; 0: the reference never moves."""
    mixup_alpha: float = 0.0
    """TR-DPO: reference.ref_model_mixup_alpha, the policy's share in each move."""
    guard: bool = False
    """train.parity_guard: step 1's live reference scores each micro-batch reordered, and must equal the policy."""
    scoring: Scoring = Scoring()
    """How the live reference's rows are scored: the policy's own `Scoring` (`build_reference`), so the two run
    the same head, the same path and the same tiles."""

    @property
    def moves(self) -> bool:
        """Whether the live copy moves (TR-DPO): its weights are then checkpoint state."""
        return self.sync_steps > 0

    @property
    def sidecar_sha256(self) -> str | None:
        """The precomputed table's sha256 (part of the run identity), or None."""
        return self.table.sha256 if self.table is not None else None

    def guards(self, step: int) -> bool:
        """Whether step `step` (counted from 0) is guarded: the first, with a live reference (a frozen copy,
        or LoRA's adapters, still at zero, switched off), which the policy then equals."""
        return self.guard and self.mode == "live" and step == 0

    def logps(self, batch: MicroBatch, step: int = -1) -> ReferenceLogps | None:
        """The summed log-probs of the batch's pairs (LD-DPO's with `ld_alpha`); None for a reference-free loss.
        On a guarded step the batch's segments are scored in another order (`reordered`): the same numbers for a
        model that packs exactly, and an independent check of the policy's."""
        if self.mode == "precomputed":
            return ReferenceLogps(*self.table.lookup(batch["pair_index"], self.place.device))
        if self.mode == "none":
            return None
        with torch.no_grad():
            ref = pair_logps(
                self.initial,
                reordered(batch) if self.guards(step) else batch,
                self.scoring,
                self.mesh,
                ld_alpha=self.ld_alpha,
            )
        return ReferenceLogps(*ref.scored)

    def join(self, inputs: dict, world: int) -> None:
        """An empty micro-batch: a sharded live reference still joins its ranks' all-gathers, in order."""
        if self.mode == "live" and world > 1:
            with torch.no_grad():
                self.initial(**inputs)

    def sync(self, policy: Any, step: int) -> None:
        """TR-DPO after optimizer step `step` (counted from 1, TRL's `global_step`): on every multiple of
        `sync_steps`, the live copy moves toward `policy` (the unwrapped policy), TRL's mixup rule."""
        if self.moves and step % self.sync_steps == 0:
            mix_into(self.initial, policy, self.mixup_alpha)

    def check_initial(
        self, policy: Any, reference: ReferenceLogps | None, batch: MicroBatch, step: int, facts: dict
    ) -> None:
        """Before the first optimizer step the policy is the reference: a sidecar's values must be its own, and
        a live reference's (`reference`, from `logps`) must equal the training forward's (`check_parity`)."""
        if self.table is not None and step == 0:
            self.table.check_initial(policy, batch["pair_index"], self.place.precision)
        if self.guards(step):
            check_parity(policy.scored, reference.scored, batch, {**facts, "precision": self.place.precision})


def build_reference(run: RunView, policy: Any, weights: str, scoring: Scoring) -> Reference:
    """The run's reference, from the initial policy before it is wrapped (a live copy is sharded like it);
    `weights`: the initial policy's fingerprint, which a precomputed table must be bound to; `scoring`: the
    policy's, with which the live reference is built (its tiles) and scored."""
    config, place, world, mesh, store = run.config, run.place, run.world, run.mesh, run.data
    mode = reference_mode(config)
    initial = None
    if mode == "live" or config.eval.path:
        lora = config.model.lora
        strategy = config.distributed.strategy
        initial = AdaptersDisabled(policy) if lora else frozen_reference(policy, strategy, world, scoring.tiles)
    table = None
    if mode == "precomputed":
        table = load_sidecar(config.reference.path, store, weights, place.precision, config.data.layout)
    sync = config.reference
    steps, alpha = (sync.ref_model_sync_steps, sync.ref_model_mixup_alpha) if sync.sync_ref_model else (0, 0.0)
    guard = config.train.parity_guard
    return Reference(mode, place, mesh, initial, table, config.loss.ld_alpha, steps, alpha, guard, scoring)
