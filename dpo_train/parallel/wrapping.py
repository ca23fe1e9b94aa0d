"""The policy as it trains over the ranks (DDP, FSDP2, or itself), and gradient accumulation without a sync."""

from __future__ import annotations

import contextlib
from typing import Any

from dpo_train.parallel.device import Placement
from dpo_train.parallel.sharding import shard


def wrap(policy: Any, strategy: str, world: int, place: Placement) -> Any:
    """DDP over `world` ranks (strategy ddp), FSDP2 (fsdp), or the policy itself on one rank."""
    if world > 1 and strategy == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(policy, device_ids=[place.device] if place.device.type != "cpu" else None)
    return shard(policy, strategy, world)


def no_sync(model: Any, strategy: str, world: int, sync: bool):
    """Gradient accumulation: the gradients sync on the step's last micro-batch (`sync`) only."""
    if world == 1 or sync:
        if world > 1 and strategy == "fsdp":
            model.set_requires_gradient_sync(True)
        return contextlib.nullcontext()
    if strategy == "ddp":
        return model.no_sync()
    model.set_requires_gradient_sync(False)
    return contextlib.nullcontext()
