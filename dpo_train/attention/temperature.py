"""Llama 4's attention temperature tuning on packed rows: a NoPE layer's query scale from each token's position."""

from __future__ import annotations

from typing import Any

import torch


def tuned(module: Any) -> bool:
    """Whether `module` scales its queries by position (Llama 4's NoPE layers with `attn_temperature_tuning`)."""
    return bool(getattr(module, "attn_temperature_tuning", False)) and not getattr(module, "use_rope", True)


def _scale(module: Any, positions: torch.Tensor) -> torch.Tensor:
    """The model's own formula: log1p(floor((p + 1) / floor_scale)) * attn_scale + 1."""
    return torch.log1p(torch.floor((positions.float() + 1.0) / module.floor_scale)) * module.attn_scale + 1.0


def by_position(module: Any, query: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """`query` [B, H, T, D] as a tuned layer hands it over, scaled by each token's index in the row
    (transformers 5.24 takes `arange(T)`, so a packed segment past `floor_scale` in the row is scaled as if
    it sat there), re-scaled by `positions` [T], the tokens' positions in their own sequences: what each
    sequence gets unpacked. For a `tuned` module only: its callers check, before making `positions`."""
    rows = torch.arange(query.shape[2], device=query.device)
    ratio = _scale(module, positions.to(query.device)) / _scale(module, rows)
    return (query.float() * ratio[None, None, :, None]).to(query.dtype)
