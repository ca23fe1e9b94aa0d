"""FSDP2 sharding of the policy, and a frozen reference that is sharded from birth (never a whole copy)."""

from __future__ import annotations

from typing import Any

import torch

from dpo_train.model import frozen_copy


def shard(model: Any, strategy: str, world: int) -> Any:
    """FSDP2 over `world` ranks (strategy fsdp): each decoder layer, then the rest; else `model` as is."""
    if world == 1 or strategy != "fsdp":
        return model
    from torch.distributed.fsdp import fully_shard

    for layer in getattr(getattr(model, "model", model), "layers", []):
        fully_shard(layer)
    fully_shard(model)
    return model


def frozen_reference(policy: Any, strategy: str, world: int) -> Any:
    """The live reference: the initial policy's weights, frozen, run without autograd.

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
