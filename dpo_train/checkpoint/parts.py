"""What a checkpoint holds: the `Stateful` parts of a run (`Checkpointable`), what the room reads of the run
(`RunView`), and a lineage."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch

from dpo_data.dataset.store import PairStore
from dpo_data.loading.config import LoaderConfig
from dpo_data.progress import say
from dpo_state.dcp_io import (
    merge_tensors,
    split_tensors,
)
from dpo_train.config.sections import TrainConfig
from dpo_train.errors import ResumeError
from dpo_train.parallel.device import Placement
from dpo_train.step.early_stopping import EarlyStopping


class Stateful(Protocol):
    """torch.distributed.checkpoint's protocol: an object that can give and take its state."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


@dataclass
class TrainState:
    """Where the loop stands: optimizer steps taken, what they consumed, and the early-stopping watch."""

    step: int = 0
    consumed: dict[str, int] = field(default_factory=lambda: {"pairs": 0, "input_tokens": 0, "supervised_tokens": 0})
    early_stopping: EarlyStopping | None = None

    def state_dict(self) -> dict[str, Any]:
        state = {"step": self.step, "consumed": dict(self.consumed)}
        if self.early_stopping is not None:
            state["early_stopping"] = self.early_stopping.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        self.consumed = {k: int(v) for k, v in state["consumed"].items()}
        if self.early_stopping is not None:
            self.early_stopping.load_state_dict(state.get("early_stopping"))


class ModelAndOptimizer:
    """The policy and its optimizer as one Stateful, split for safe storage: `tensors` (sharded state
    dicts under FSDP2) go to DCP, `tree` (the structure and every non-tensor value) goes to JSON."""

    def __init__(self, model: Any, optimizer: torch.optim.Optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(self.model, self.optimizer, options=self._options())
        model_tensors, model_tree = split_tensors(model_state, "model")
        optim_tensors, optim_tree = split_tensors(optim_state, "optim")
        return {
            "tensors": {"model": model_tensors or {}, "optim": optim_tensors or {}},
            "tree": {"model": model_tree, "optim": optim_tree},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_state_dict

        tensors, tree = state["tensors"], state["tree"]
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=merge_tensors(tree["model"], tensors["model"]),
            optim_state_dict=merge_tensors(tree["optim"], tensors["optim"]),
            options=self._options(),
        )

    def _options(self):
        """Frozen parameters (the base weights under LoRA) are not saved: they are the model's own, checked
        by the reference weights fingerprint. Loading then fills only the trainable ones (DCP has already
        refused a checkpoint that lacks any of them)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions

        frozen = any(not p.requires_grad for p in self.model.parameters())
        return StateDictOptions(ignore_frozen_params=True, strict=not frozen)


class ReferenceWeights:
    """The live reference's weights once TR-DPO moves them (reference.sync_ref_model): tensors only, to DCP
    beside the policy's, sharded as the reference is (FSDP2 shards, or the whole copy)."""

    def __init__(self, model: Any):
        self.model = model

    def state_dict(self) -> dict[str, Any]:
        from torch.distributed.checkpoint.state_dict import get_model_state_dict

        return get_model_state_dict(self.model)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        from torch.distributed.checkpoint.state_dict import set_model_state_dict

        set_model_state_dict(self.model, state)


class RNGState:
    """This process's generator states, by device kind: cpu always, and the rank's accelerator (cuda, or
    npu through torch-npu, whose generators live in `torch.npu`) when the run is on one."""

    def __init__(self, device_kind: str = "cpu"):
        self.kinds = ["cpu"] if device_kind == "cpu" else ["cpu", device_kind]

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {kind: _generator(kind).get_rng_state() for kind in self.kinds}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        if sorted(state) != sorted(self.kinds):
            raise ResumeError(
                f"the checkpoint holds generator states for {', '.join(sorted(state))}, this run needs "
                f"{', '.join(self.kinds)}: it was saved on another device kind; resume on that kind, or start a "
                "new run from its weights with train.weights_from"
            )
        for kind in self.kinds:
            _generator(kind).set_rng_state(state[kind])


def _generator(kind: str) -> Any:
    """The module holding `kind`'s default generator: torch (cpu), torch.cuda, torch.npu."""
    return torch if kind == "cpu" else getattr(torch, kind)


@dataclass
class Checkpointable:
    """Everything a checkpoint holds, and where each part goes."""

    model: ModelAndOptimizer
    """-> dcp/ (tensors, sharded as trained) and state_tree.json (everything else, as JSON)."""
    scheduler: Stateful
    """-> state.json `scheduler_state`."""
    loader: Stateful
    """-> rank-RRRRR.json, one per rank."""
    rng: Stateful
    """-> rank-RRRRR.rng.safetensors, one per rank."""
    train: TrainState
    """-> state.json `step`, `consumed` and (with eval.early_stopping_metric) `early_stopping`."""
    reference: Stateful | None = None
    """-> dcp/ `reference` (tensors only), when the reference moves (TR-DPO); None: it is the initial policy,
    rebuilt on resume and checked by the reference weights fingerprint."""


class RunView(Protocol):
    """What this room reads of a run: a `dpo_train.run.setup.Run`, which it cannot import (the run room is
    above it). Its config gives `train.keep_last`, `train.save_every`, `train.resume` and the resolved config
    state.json records."""

    config: TrainConfig
    place: Placement
    rank: int
    world: int
    data: PairStore
    """The training data, whose fingerprints the identity records."""
    out: Path | None
    shown: bool
    """This rank says what long stages do: a save is one."""

    @property
    def geometry(self) -> LoaderConfig:
        """This rank's loader config, as the identity's layout records it."""


def new_lineage() -> dict:
    return {"run_id": uuid.uuid4().hex, "parent": None, "resumed_from": None}


def dcp_tensors(parts: Checkpointable, model_state: dict) -> dict:
    """What DCP holds: the model and optimizer tensors, and the reference's when it moves."""
    reference = {"reference": parts.reference.state_dict()} if parts.reference is not None else {}
    return {**model_state["tensors"], **reference}


def warn(rank: int, message: str) -> None:
    if rank == 0:
        say(f"warning: {message}")
