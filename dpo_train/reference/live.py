"""The live reference: the initial policy frozen (a copy, sharded from birth under FSDP2) or, under LoRA, the
policy itself with its adapters off; TR-DPO's move of the copy toward the policy."""

from __future__ import annotations

import copy
from typing import Any

import torch

from dpo_train.logps.tiled_mlp import apply_tiles
from dpo_train.parallel.sharding import shard


def frozen_copy(model: Any) -> Any:
    """A copy that never trains and runs without autograd."""
    return copy.deepcopy(model).eval().requires_grad_(False)


def frozen_reference(policy: Any, strategy: str, world: int, tiles: tuple[tuple[str, int], ...]) -> Any:
    """The initial policy's weights, frozen, run without autograd.

    Under FSDP2 it is sharded like the policy, and built so that no rank ever holds a second whole
    copy: the same architecture is created on the meta device, sharded, allocated shard by shard on
    the policy's device, then filled from the (still unsharded) policy's state dict, each rank keeping
    its own shard. Buffers that are not in the state dict (rotary frequencies) are copied as they are.
    Otherwise (one rank, or DDP, where every rank holds the whole model anyway) it is a plain copy. A copy runs
    its MLPs as the policy's classes say; the sharded one is tiled as `tiles` says (`Scoring.tiles`, the policy's).
    Either way the run scores it with the policy's `Scoring` (its logits budget, its path): nothing is copied.
    """
    if world == 1 or strategy != "fsdp":
        return frozen_copy(policy)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    device = next(policy.parameters()).device
    with torch.device("meta"):  # the policy's own class: a vision-language model is no AutoModelForCausalLM
        reference = type(policy)._from_config(policy.config, dtype=next(policy.parameters()).dtype)
    reference.eval().requires_grad_(False)
    shard(reference, strategy, world)
    reference.to_empty(device=device)
    set_model_state_dict(reference, policy.state_dict(), options=StateDictOptions(full_state_dict=True))
    for name, buffer in policy.named_buffers():
        reference.get_buffer(name).copy_(buffer)
    apply_tiles(reference, tiles)  # its MLPs as the policy runs them
    return reference


def mix_into(reference: Any, policy: Any, alpha: float) -> None:
    """TR-DPO's move, TRL 1.16's rule (`SyncRefModelCallback._sync_target_model`): every reference parameter
    becomes (1 - alpha) ref + alpha policy, in place, in the same two operations.

    Under FSDP2 the copy is sharded like the policy (`frozen_reference`): each parameter pair is two DTensors
    with the same mesh and placements, so each rank mixes its own local shards and no gather is needed. FSDP2
    keeps the root's parameters unsharded after a forward; both are resharded first, so that the shards (the
    weights that persist) are what moves, not a gathered copy that the next reshard would drop."""
    _reshard(reference)
    _reshard(policy)
    source = dict(policy.named_parameters())
    with torch.no_grad():
        for name, target in reference.named_parameters():
            mine, theirs = _local_pair(name, target, source[name])
            mine.mul_(1.0 - alpha).add_(theirs, alpha=alpha)


def _reshard(model: Any) -> None:
    """Every FSDP2 unit of `model` back on its sharded parameters (a no-op for one that is, or for a plain model)."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _local_pair(name: str, target: torch.Tensor, source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The local tensors of a reference parameter and its policy parameter: DTensor shards laid out alike, or
    two plain tensors."""
    from torch.distributed.tensor import DTensor

    if isinstance(target, DTensor) or isinstance(source, DTensor):
        assert isinstance(target, DTensor) and isinstance(source, DTensor), name
        assert (target.device_mesh, target.placements) == (source.device_mesh, source.placements), name
        target, source = target.to_local(), source.to_local()
    assert target.shape == source.shape, name
    return target, source


class AdaptersDisabled:
    """The live reference under LoRA: the policy itself, called with its adapters disabled, without
    gradients. No second copy of the weights exists; under FSDP2 it all-gathers the policy's shards.

    PEFT's own `disable_adapter()` also switches the adapters' `requires_grad` off and on again; under
    FSDP2 that flag lands on other parameter objects than the sharded ones the optimizer and the
    checkpoint see, and a saved checkpoint came out without its adapters. So the layers' switch alone
    is flipped here: the flag every PEFT tuner layer reads in its forward (`disable_adapters`)."""

    def __init__(self, model: Any):
        from peft.tuners.tuners_utils import BaseTunerLayer

        self.model = model
        self.layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]

    def __call__(self, *args, **kwargs):
        training = self.model.training  # the reference scores in eval mode, as the frozen copy does
        try:
            for layer in self.layers:
                layer._disable_adapters = True
            self.model.train(False)
            return self.model(*args, **kwargs)
        finally:
            self.model.train(training)
            for layer in self.layers:
                layer._disable_adapters = False

    def parameters(self):
        return self.model.parameters()

    @property
    def training(self) -> bool:
        return self.model.training

    def train(self, mode: bool = True) -> AdaptersDisabled:
        self.model.train(mode)
        return self

    def eval(self) -> AdaptersDisabled:
        return self.train(False)
