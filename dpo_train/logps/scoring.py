"""How a model's rows are scored: the values fixed at start-up that every forward of the run is passed."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scoring:
    """What `pair_logps` needs of a run besides the model and the row, built once at start-up
    (`dpo_train.run.initial_policy`) and passed to every forward: the policy's, the reference's (the same
    object, so the two cannot score differently), held-out evaluation's, the precompute's and the checks'."""

    unpacked: bool = False
    """The model's rows run as a padded batch of their sequences (`dpo_train.attention.unpacked`): chosen by
    model.attention unpacked, or by auto for a model packing cannot serve (at load or by the start-up probe)."""
    logits_budget: int | None = None
    """Bytes the whole vocabulary head's logits may take before the chunked head scores instead
    (train.logits_budget_mib, once `check_head` found the chunked head equal to the model's own; None: the
    model's own head always)."""
    compiled_head: bool | str = "auto"
    """train.compiled_head (its values: the field in dpo_train/config/sections.py): where the chunked head's bodies
    run compiled; auto on CUDA only, true on any device, false never (`compiled.compiles_on`)."""
    tiles: tuple[tuple[str, int], ...] = ()
    """(module name, tile in positions) of each MLP that runs tiled (`tiled_mlp`), as the policy's were tiled at
    start-up: a reference built apart from the policy (FSDP2's) tiles the same modules."""

    def __post_init__(self) -> None:
        if self.compiled_head != "auto" and not isinstance(self.compiled_head, bool):  # 1 is not True here
            raise ValueError(
                f"train.compiled_head is {self.compiled_head!r}: one of auto, true, false; set one of them"
            )

    @property
    def mlp_tile(self) -> int | None:
        """The tile the model's MLPs run with (None: whole), as the checkpoint identity records it."""
        return self.tiles[0][1] if self.tiles else None
