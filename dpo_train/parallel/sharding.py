"""FSDP2 sharding of a model: each decoder layer, then the rest."""

from __future__ import annotations

from typing import Any


def shard(model: Any, strategy: str, world: int) -> Any:
    """FSDP2 over `world` ranks (strategy fsdp): each decoder layer, then the rest; else `model` as is."""
    if world == 1 or strategy != "fsdp":
        return model
    from torch.distributed.fsdp import fully_shard

    for layer in getattr(getattr(model, "model", model), "layers", []):
        fully_shard(layer)
    fully_shard(model)
    return model
