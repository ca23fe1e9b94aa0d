"""What a backward that recomputes part of its forward needs to run it alike: the forward's autocast."""

from __future__ import annotations

import torch


def autocast_state(device_type: str) -> dict:
    """The autocast the forward runs under on `device_type`, as keyword arguments of `torch.autocast`, so that a
    backward recomputing that forward (the chunked head's logits, a tiled MLP's tiles) computes alike."""
    if not torch.is_autocast_enabled(device_type):
        return {"enabled": False}
    return {"enabled": True, "dtype": torch.get_autocast_dtype(device_type)}
