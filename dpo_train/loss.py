"""The DPO loss family on per-pair log-probabilities: closed forms, one value per pair, no reduction.

The step, not the loss, reduces: it sums pair losses and divides by the number of pairs in the whole
optimizer step, so every pair weighs the same whatever the packing (docs/objective.md).
Notation: for a pair, c = log pi(chosen), r = log pi(rejected) (summed over completion tokens, or
averaged with `average_log_prob`), c0 and r0 the same under the reference, |c| and |r| completion
token counts, and the margin  D = (c - c0) - (r - r0).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dpo_train.errors import ConfigError

LOSS_TYPES = ("sigmoid", "ipo", "hinge", "robust", "simpo")
REFERENCE_FREE = ("simpo",)


@dataclass(frozen=True)
class LossConfig:
    """The `loss:` section of the training config."""

    type: str = "sigmoid"
    """sigmoid | ipo | hinge | robust | simpo."""
    beta: float = 0.1
    """Inverse temperature (IPO: the regularization tau; SimPO: the reward scale)."""
    label_smoothing: float = 0.0
    """sigmoid: conservative DPO's flip probability in [0, 0.5]; robust: in [0, 0.5)."""
    nll_weight: float = 0.0
    """Weight of the NLL on chosen completions (RPO), per supervised chosen token over the whole step."""
    average_log_prob: bool = False
    """Use per-token mean log-probs instead of sums (always on for ipo and simpo)."""
    target_margin: float = 0.5
    """simpo: the target reward margin gamma."""
    router_aux_coef: float | None = None
    """Mixture-of-experts models (their config has `output_router_logits`): weight of the router
    load-balancing loss the model returns, added per micro-batch and weighted by its share of the step's
    pairs (docs/objective.md, "MoE"). null: the model config's `router_aux_loss_coef` (0 without one),
    as TRL does; 0 disables it."""

    def __post_init__(self):
        if self.type not in LOSS_TYPES:
            raise ConfigError(f"loss.type is {self.type!r}; allowed: {', '.join(LOSS_TYPES)}")
        if not self.beta > 0:
            raise ConfigError(f"loss.beta is {self.beta}; it must be > 0")
        e, robust = self.label_smoothing, self.type == "robust"
        if not (0.0 <= e < 0.5 if robust else 0.0 <= e <= 0.5):  # robust divides by 1 - 2e
            raise ConfigError(f"loss.label_smoothing is {e}; {self.type} allows [0, 0.5{')' if robust else ']'}")
        if self.label_smoothing and self.type not in ("sigmoid", "robust"):
            raise ConfigError(f"loss.label_smoothing is {self.label_smoothing}, but {self.type} has none; set it to 0")
        if self.nll_weight < 0:
            raise ConfigError(f"loss.nll_weight is {self.nll_weight}; it must be >= 0")
        if self.router_aux_coef is not None and not self.router_aux_coef >= 0:
            raise ConfigError(
                f"loss.router_aux_coef is {self.router_aux_coef}; it must be >= 0, or null for the model's own"
            )

    @property
    def needs_reference(self) -> bool:
        return self.type not in REFERENCE_FREE


@dataclass
class PairTerms:
    """Per-pair values: the loss and the implicit rewards (for metrics)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


def pair_losses(
    config: LossConfig,
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor | None,
    ref_rejected: torch.Tensor | None,
    chosen_tokens: torch.Tensor,
    rejected_tokens: torch.Tensor,
) -> PairTerms:
    """Per-pair losses from summed completion log-probs (and token counts for the averaged forms).

    - sigmoid: L = -(1 - e) log s(b D) - e log s(-b D)   (e = label_smoothing; e > 0 is conservative DPO)
    - ipo:     L = (D_avg - 1 / (2 b))^2, D_avg the margin of per-token means (as TRL 1.16 normalizes)
    - hinge:   L = max(0, 1 - b D)
    - robust:  L = (-(1 - e) log s(b D) + e log s(-b D)) / (1 - 2 e)
    - simpo:   L = -log s(b (c/|c| - r/|r|) - gamma), no reference
    with s the logistic function. Rewards: b (c - c0) and b (r - r0); simpo: b c/|c| and b r/|r|.
    """
    b, e = config.beta, config.label_smoothing
    n_c, n_r = chosen_tokens.to(chosen.dtype).clamp(min=1), rejected_tokens.to(chosen.dtype).clamp(min=1)
    if config.type == "simpo":
        chosen_reward, rejected_reward = b * chosen / n_c, b * rejected / n_r
        losses = -F.logsigmoid(chosen_reward - rejected_reward - config.target_margin)
        return PairTerms(losses, chosen_reward.detach(), rejected_reward.detach())
    if ref_chosen is None or ref_rejected is None:
        raise ConfigError(
            f"loss.type {config.type} needs reference log-probs; set reference.mode to live or precomputed"
        )
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    if config.average_log_prob or config.type == "ipo":
        chosen_ratio, rejected_ratio = chosen_ratio / n_c, rejected_ratio / n_r
    margin = chosen_ratio - rejected_ratio
    if config.type == "sigmoid":
        losses = -(1 - e) * F.logsigmoid(b * margin) - e * F.logsigmoid(-b * margin)
    elif config.type == "ipo":
        losses = (margin - 1 / (2 * b)) ** 2
    elif config.type == "hinge":
        losses = torch.relu(1 - b * margin)
    else:  # robust
        losses = (-(1 - e) * F.logsigmoid(b * margin) + e * F.logsigmoid(-b * margin)) / (1 - 2 * e)
    return PairTerms(losses, (b * chosen_ratio).detach(), (b * rejected_ratio).detach())
