"""The step objective: every pair of an optimizer step weighs 1 / (pairs in the step), whatever the packing."""

from __future__ import annotations

import torch
import torch.distributed as dist


def _gradient_scale() -> float:
    """Data-parallel gradient reduction averages over ranks; multiplying each rank's contribution by the
    world size turns that average into the sum the step mean needs."""
    return float(dist.get_world_size()) if dist.is_available() and dist.is_initialized() else 1.0


def microbatch_loss(
    pair_losses: torch.Tensor,
    step_pairs: float,
    nll_sum: torch.Tensor | None = None,
    step_chosen_tokens: float = 0.0,
    nll_weight: float = 0.0,
) -> torch.Tensor:
    """This micro-batch's share of the step objective, to call backward on.

    step loss = sum over the step's pairs of L_i / N_step  +  nll_weight * (sum of -log p over the
    step's chosen completion tokens) / (chosen completion tokens in the step)
    Summing this over micro-batches and ranks (with `_gradient_scale`) gives exactly that step loss and
    its gradient: never a mean of per-micro-batch means. An empty micro-batch contributes 0.
    """
    loss = pair_losses.sum() / step_pairs
    if nll_weight and nll_sum is not None and step_chosen_tokens:
        loss = loss + nll_weight * nll_sum / step_chosen_tokens
    return loss * _gradient_scale()
