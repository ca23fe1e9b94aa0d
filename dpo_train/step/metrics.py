"""Step metrics: per-pair sums all-reduced at the end of a step, reported as ratios (never a mean of means)."""

from __future__ import annotations

import time

import torch

METRICS_FORMAT_VERSION = 3
"""Every metrics.jsonl record carries it; schema `metrics-record` (2: time, microbatches, fill_histogram; 3:
`loss` is the whole optimized objective, as TRL logs it, its pair part `pair_loss`, also per source)."""

FILL_BINS = 10
"""The micro-batch fill histogram: input tokens / max_tokens_per_microbatch in tenths, the last bin closed."""

# Row 0 holds all pairs of the step, row 1 + s the pairs of source s: a pair counts once.
PAIR_SUMS = (
    "loss",
    "chosen_reward",
    "rejected_reward",
    "correct",
    "margin",
    "chosen_logp",
    "rejected_logp",
    "nll",
    "chosen_tokens",
    "pairs",
    "input_tokens",
    "supervised_tokens",
)
# Per micro-batch holding pairs, row 0 only: its token capacity, and its fill in the histogram.
# aux_loss: the router load-balancing loss times the micro-batch's pairs (MoE with loss.router_aux_coef).
MICROBATCH_SUMS = ("capacity", "microbatches", *(f"fill_{b}" for b in range(FILL_BINS)), "aux_loss")
SUMS = PAIR_SUMS + MICROBATCH_SUMS


def new_sums(sources: int) -> torch.Tensor:
    return torch.zeros(1 + sources, len(SUMS), dtype=torch.float64)


def add_pairs(sums: torch.Tensor, batch: dict, terms, policy, capacity: int) -> None:
    """Add one micro-batch's pairs to the step sums."""
    margin = terms.chosen_rewards - terms.rejected_rewards
    # tokens each pair put through the model: both segments, or prompt once plus both completions
    owner = batch["segment_pair"].long().to(margin.device)
    lengths = batch["segment_length"].to(margin.device, margin.dtype)
    input_tokens = torch.zeros_like(margin).index_add(0, owner[owner >= 0], lengths[owner >= 0])
    per_pair = (
        torch.stack(
            [
                terms.losses.detach(),
                terms.chosen_rewards,
                terms.rejected_rewards,
                (margin > 0).float(),
                margin,
                policy.chosen.detach(),
                policy.rejected.detach(),
                -policy.chosen.detach(),
                policy.chosen_tokens,
                torch.ones_like(margin),
                input_tokens,
                policy.chosen_tokens + policy.rejected_tokens,
            ],
            dim=1,
        )
        .double()
        .cpu()
    )
    pair_sums = sums[:, : len(PAIR_SUMS)]
    pair_sums[0] += per_pair.sum(0)
    pair_sums.index_add_(0, 1 + batch["pair_source"].cpu().long(), per_pair)
    sums[0, SUMS.index("capacity")] += capacity
    sums[0, SUMS.index("microbatches")] += 1
    fill = float(per_pair[:, PAIR_SUMS.index("input_tokens")].sum()) / capacity  # on CPU already: no device sync
    sums[0, SUMS.index("fill_0") + min(int(fill * FILL_BINS), FILL_BINS - 1)] += 1
    if policy.aux_loss is not None:
        sums[0, SUMS.index("aux_loss")] += float(policy.aux_loss.detach()) * len(margin)


def step_record(
    sums: torch.Tensor,
    sources: list[str],
    grad_norm: float,
    lr: float,
    step: int,
    seconds: float,
    world_size: int = 1,
    nll_weight: float = 0.0,
    router_aux_coef: float = 0.0,
) -> dict:
    """The metrics.jsonl object of one optimizer step, from sums over all ranks; `time` is when it ended
    (Unix seconds), for a report's wall-clock axis. `loss` is the step objective (`objective_value`) with
    the NLL term's weight `nll_weight` and the router coefficient `router_aux_coef`; `pair_loss` its pair
    part; with `router_aux_coef`, `aux_loss` is the pair-weighted mean of the micro-batches' router
    load-balancing losses (unscaled by the coefficient)."""
    s = dict(zip(SUMS, sums[0].tolist()))
    pairs = max(s["pairs"], 1.0)
    parts = {
        "pair_loss": s["loss"] / pairs,
        "nll": s["nll"] / s["chosen_tokens"] if s["chosen_tokens"] else 0.0,
        "aux_loss": s["aux_loss"] / pairs,
    }
    aux = {"aux_loss": parts["aux_loss"]} if router_aux_coef else {}
    return {
        "format_version": METRICS_FORMAT_VERSION,
        "step": step,
        "world_size": world_size,
        "loss": objective_value(parts, nll_weight, router_aux_coef),
        "pair_loss": parts["pair_loss"],
        "rewards/chosen": s["chosen_reward"] / pairs,
        "rewards/rejected": s["rejected_reward"] / pairs,
        "rewards/accuracies": s["correct"] / pairs,
        "rewards/margins": s["margin"] / pairs,
        "logps/chosen": s["chosen_logp"] / pairs,
        "logps/rejected": s["rejected_logp"] / pairs,
        "nll": parts["nll"],
        **aux,
        "grad_norm": grad_norm,
        "lr": lr,
        "pairs": int(s["pairs"]),
        "input_tokens": int(s["input_tokens"]),
        "supervised_tokens": int(s["supervised_tokens"]),
        "packing_efficiency": s["input_tokens"] / s["capacity"] if s["capacity"] else 0.0,
        "microbatches": int(s["microbatches"]),
        "fill_histogram": [int(s[f"fill_{b}"]) for b in range(FILL_BINS)],
        "time": time.time(),
        "pairs/s": s["pairs"] / seconds,
        "tokens/s": s["input_tokens"] / seconds,
        "sources": {
            name: _source_record(dict(zip(SUMS, row)))
            for name, row in zip(sources, sums[1:].tolist())
            if row[SUMS.index("pairs")]
        },
    }


def objective_value(parts: dict, nll_weight: float, router_aux_coef: float) -> float:
    """The step objective `microbatch_loss` sums to (docs/objective.md, "What is logged"), from its parts:
    pair_loss + nll_weight * nll + router_aux_coef * aux_loss. A part whose weight is 0 is left out, so a
    part that is not finite but not optimized does not make the logged objective so."""
    loss = parts["pair_loss"]
    if nll_weight:
        loss += nll_weight * parts["nll"]
    if router_aux_coef:
        loss += router_aux_coef * parts["aux_loss"]
    return loss


def _source_record(s: dict) -> dict:
    """Per-source metrics: a pair counts once, in its own source. `pair_loss` is the source's pair part of
    the objective (the NLL and router terms are the step's, not a source's)."""
    return {
        "pairs": int(s["pairs"]),
        "pair_loss": s["loss"] / s["pairs"],
        "accuracy": s["correct"] / s["pairs"],
        "margin": s["margin"] / s["pairs"],
        "input_tokens": int(s["input_tokens"]),
        "supervised_tokens": int(s["supervised_tokens"]),
    }
