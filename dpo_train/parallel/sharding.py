"""FSDP2 sharding of a model: each decoder layer, then the rest."""

from __future__ import annotations

from typing import Any


def shard(model: Any, strategy: str, world: int) -> Any:
    """FSDP2 over `world` ranks (strategy fsdp): each decoder layer, then the rest; else `model` as is."""
    if world == 1 or strategy != "fsdp":
        return model
    from torch.distributed.fsdp import fully_shard

    for layer in _decoder_layers(model):
        fully_shard(layer)
    fully_shard(model)
    return model


def _decoder_layers(model: Any) -> Any:
    """The decoder layers: `model.model.layers`, or a vision-language model's (a config with a `vision_config`,
    whose `model` holds a language model beside its vision tower and connector) decoder's: the tower and connector
    stay in the root unit, whose parameters every rank's loss reaches (`model.policy.reached_by_every_rank`)."""
    if hasattr(getattr(model, "config", None), "vision_config"):  # through PEFT's wrapper too
        return model.get_decoder().layers
    return getattr(getattr(model, "model", model), "layers", [])  # a text LoRA model: none (the root unit)
