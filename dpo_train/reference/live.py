"""The live reference: the initial policy frozen (a copy, sharded from birth under FSDP2) or, under LoRA, the
policy itself with its adapters off."""

from __future__ import annotations

import copy
from typing import Any

import torch

from dpo_train.parallel.sharding import shard


def frozen_copy(model: Any) -> Any:
    """A copy that never trains and runs without autograd."""
    return copy.deepcopy(model).eval().requires_grad_(False)


def frozen_reference(policy: Any, strategy: str, world: int) -> Any:
    """The initial policy's weights, frozen, run without autograd.

    Under FSDP2 it is sharded like the policy, and built so that no rank ever holds a second whole
    copy: the same architecture is created on the meta device, sharded, allocated shard by shard on
    the policy's device, then filled from the (still unsharded) policy's state dict, each rank keeping
    its own shard. Buffers that are not in the state dict (rotary frequencies) are copied as they are.
    Otherwise (one rank, or DDP, where every rank holds the whole model anyway) it is a plain copy.
    """
    if world == 1 or strategy != "fsdp":
        return frozen_copy(policy)
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoModelForCausalLM

    device = next(policy.parameters()).device
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(policy.config, dtype=next(policy.parameters()).dtype)
    reference.eval().requires_grad_(False)
    shard(reference, strategy, world)
    reference.to_empty(device=device)
    set_model_state_dict(reference, policy.state_dict(), options=StateDictOptions(full_state_dict=True))
    for name, buffer in policy.named_buffers():
        reference.get_buffer(name).copy_(buffer)
    return reference


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
        try:
            for layer in self.layers:
                layer._disable_adapters = True
            return self.model(*args, **kwargs)
        finally:
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
