"""The step objective: every pair of an optimizer step weighs 1 / (pairs in the step), whatever the packing."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from dpo_train.attention.features import computes_router_loss, text_config
from dpo_train.errors import ConfigError


def _gradient_scale() -> float:
    """Data-parallel gradient reduction averages over ranks; multiplying each rank's contribution by the
    world size turns that average into the sum the step mean needs."""
    return float(dist.get_world_size()) if dist.is_available() and dist.is_initialized() else 1.0


def router_aux_coef(
    requested: float | None, model: Any, attention: str, sequence_parallel: bool, unpacked: bool
) -> float:
    """The router load-balancing coefficient a run uses, as TRL resolves it: on for a mixture-of-experts
    model (its config has `output_router_logits`) with the config's `router_aux_loss_coef`, unless
    `loss.router_aux_coef` says otherwise; refused where it cannot be computed exactly. `unpacked`: the model's
    rows run unpacked (`Scoring.unpacked`), where sdpa and eager see a padding mask."""
    config = text_config(model)
    moe = hasattr(config, "output_router_logits") and computes_router_loss(model)
    coef = float(getattr(config, "router_aux_loss_coef", 0.0) or 0.0) if requested is None else float(requested)
    if not moe:
        if requested:
            raise ConfigError(
                f"loss.router_aux_coef is {requested}, but {type(model).__name__} computes no router "
                "load-balancing loss (not a mixture-of-experts model, or one without that loss, as Llama 4, "
                "GLM-4-MoE or dots1); set it to null or 0"
            )
        return 0.0
    if coef and sequence_parallel:
        raise ConfigError(
            "loss.router_aux_coef: the router load-balancing loss is a statistic of the whole row, and under "
            "distributed.sequence_parallel each rank sees a part of it; set loss.router_aux_coef: 0"
        )
    if coef and attention in ("sdpa", "eager") and not unpacked:  # unpacked: a padding mask
        raise ConfigError(
            f"loss.router_aux_coef with model.attention {attention}: transformers reads the attention mask "
            "as a [batch, tokens] padding mask for the load-balancing loss, and a packed row's mask is "
            "per layer kind; use model.attention auto or segments, or set loss.router_aux_coef: 0"
        )
    return coef


def microbatch_loss(
    pair_losses: torch.Tensor,
    step_pairs: float,
    nll_sum: torch.Tensor | None = None,
    step_chosen_tokens: float = 0.0,
    nll_weight: float = 0.0,
    aux_loss: torch.Tensor | None = None,
    router_aux_coef: float = 0.0,
) -> torch.Tensor:
    """This micro-batch's share of the step objective, to call backward on.

    step loss = sum over the step's pairs of L_i / N_step  +  nll_weight * (sum of -log p over the
    step's chosen completion tokens) / (chosen completion tokens in the step)
              + router_aux_coef * sum over micro-batches m of aux_m * n_m / N_step
    where aux_m is micro-batch m's router load-balancing loss and n_m its pairs: a statistic of the
    micro-batch, weighted by its share of the step's pairs (docs/objective.md, "MoE").
    Summing this over micro-batches and ranks (with `_gradient_scale`) gives exactly that step loss and
    its gradient: never a mean of per-micro-batch means. An empty micro-batch contributes 0.
    """
    loss = pair_losses.sum() / step_pairs
    if nll_weight and nll_sum is not None and step_chosen_tokens:
        loss = loss + nll_weight * nll_sum / step_chosen_tokens
    if router_aux_coef and aux_loss is not None:
        loss = loss + router_aux_coef * aux_loss * len(pair_losses) / step_pairs
    return loss * _gradient_scale()
