"""The DPO loss family on per-pair log-probabilities: closed forms, one value per pair, no reduction.

The step, not the loss, reduces: it sums pair losses and divides by the number of pairs in the whole
optimizer step, so every pair weighs the same whatever the packing (docs/objective.md).
Notation: for a pair, c = log pi(chosen), r = log pi(rejected) (summed over completion tokens, or
averaged with `average_log_prob`), c0 and r0 the same under the reference, |c| and |r| completion
token counts, and the margin  D = (c - c0) - (r - r0).

`LOSSES` is the family: one `LossType` per `loss.type` name, and the only list of them. The per-pair
computation, `LossConfig.needs_reference` and the config's checks (dpo_train/config.py) all read it.
Adding a loss type is one entry here (its closed form in the function's docstring) plus its row in the
docs/objective.md table (tests/test_loss.py checks the table's facts against the entries) and its name
in the `loss.type` enum of schemas/train-config.schema.json, which is for editors and must list the same
names in the same order (tests/test_config.py checks it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from dpo_train.errors import ConfigError

Counts = tuple[torch.Tensor, torch.Tensor]
"""Completion token counts of (chosen, rejected), at least 1, in the log-probs' dtype."""


@dataclass(frozen=True)
class LossConfig:
    """The `loss:` section of the training config; checked by dpo_train/config.py (`config_problems`)
    and the schema, never here."""

    type: str = "sigmoid"
    """A name of `LOSSES` (the table in docs/objective.md)."""
    beta: float = 0.1
    """Inverse temperature (IPO: the regularization tau; SimPO: the reward scale)."""
    label_smoothing: float = 0.0
    """For the types whose `LOSSES` entry gives it a range (sigmoid: conservative DPO's flip probability);
    0 for the others."""
    nll_weight: float = 0.0
    """Weight of the NLL on chosen completions (RPO), per supervised chosen token over the whole step."""
    average_log_prob: bool = False
    """Use per-token mean log-probs instead of sums (always on for the types whose `LOSSES` entry says
    per_token_means)."""
    target_margin: float = 0.5
    """simpo: the target reward margin gamma."""
    router_aux_coef: float | None = None
    """Mixture-of-experts models (their config has `output_router_logits`): weight of the router
    load-balancing loss the model returns, added per micro-batch and weighted by its share of the step's
    pairs (docs/objective.md, "MoE"). null: the model config's `router_aux_loss_coef` (0 without one),
    as TRL does; 0 disables it."""

    @property
    def needs_reference(self) -> bool:
        return loss_type(self.type).needs_reference


@dataclass(frozen=True)
class Interval:
    """A range of a number: [low, high], or [low, high) with `open_high`."""

    low: float
    high: float
    open_high: bool = False

    def __contains__(self, value: float) -> bool:
        return self.low <= value < self.high if self.open_high else self.low <= value <= self.high

    def __str__(self) -> str:
        return f"[{self.low:g}, {self.high:g}{')' if self.open_high else ']'}"


Form = Callable[[LossConfig, torch.Tensor, torch.Tensor, Counts | None], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class LossType:
    """One member of the loss family: its closed form and every fact the rest of the code asks about it."""

    form: Form
    """(config, chosen, rejected, counts) -> (losses, chosen rewards, rejected rewards), per pair.
    chosen and rejected are the summed log-ratios c - c0 and r - r0 (c and r for a reference-free type);
    counts are the token counts where per-token means apply (the type's or `average_log_prob`), else None.
    The form takes the means itself, so that each keeps its own order of operations."""
    needs_reference: bool = True
    """False: reference-free (reference.mode may be none; reference log-probs are never read)."""
    label_smoothing: Interval | None = None
    """The range `loss.label_smoothing` may take; None: the type has none, and it must be 0."""
    per_token_means: bool = False
    """Always per-token mean log-probs, whatever `loss.average_log_prob` says."""


def _of_margin(loss: Callable[[LossConfig, torch.Tensor], torch.Tensor]) -> Form:
    """A form from a closed form of the margin D alone; rewards b (c - c0) and b (r - r0)."""

    def form(config: LossConfig, chosen: torch.Tensor, rejected: torch.Tensor, counts: Counts | None):
        if counts is not None:
            chosen, rejected = chosen / counts[0], rejected / counts[1]
        return loss(config, chosen - rejected), config.beta * chosen, config.beta * rejected

    return form


@_of_margin
def _sigmoid(config: LossConfig, margin: torch.Tensor) -> torch.Tensor:
    """L = -(1 - e) log s(b D) - e log s(-b D)   (e = label_smoothing; e > 0 is conservative DPO)."""
    b, e = config.beta, config.label_smoothing
    return -(1 - e) * F.logsigmoid(b * margin) - e * F.logsigmoid(-b * margin)


@_of_margin
def _ipo(config: LossConfig, margin: torch.Tensor) -> torch.Tensor:
    """L = (D_avg - 1 / (2 b))^2, D_avg the margin of per-token means (as TRL 1.16 normalizes)."""
    return (margin - 1 / (2 * config.beta)) ** 2


@_of_margin
def _hinge(config: LossConfig, margin: torch.Tensor) -> torch.Tensor:
    """L = max(0, 1 - b D)."""
    return torch.relu(1 - config.beta * margin)


@_of_margin
def _robust(config: LossConfig, margin: torch.Tensor) -> torch.Tensor:
    """L = (-(1 - e) log s(b D) + e log s(-b D)) / (1 - 2 e)   (hence e < 0.5)."""
    b, e = config.beta, config.label_smoothing
    return (-(1 - e) * F.logsigmoid(b * margin) + e * F.logsigmoid(-b * margin)) / (1 - 2 * e)


def _simpo(config: LossConfig, chosen: torch.Tensor, rejected: torch.Tensor, counts: Counts | None):
    """L = -log s(b c/|c| - b r/|r| - gamma), no reference; rewards b c/|c| and b r/|r|."""
    (n_c, n_r), b = counts, config.beta
    chosen_reward, rejected_reward = b * chosen / n_c, b * rejected / n_r
    return -F.logsigmoid(chosen_reward - rejected_reward - config.target_margin), chosen_reward, rejected_reward


LOSSES: dict[str, LossType] = {
    "sigmoid": LossType(_sigmoid, label_smoothing=Interval(0.0, 0.5)),
    "ipo": LossType(_ipo, per_token_means=True),
    "hinge": LossType(_hinge),
    "robust": LossType(_robust, label_smoothing=Interval(0.0, 0.5, open_high=True)),
    "simpo": LossType(_simpo, needs_reference=False, per_token_means=True),
}
"""The loss family, by `loss.type` name (s is the logistic function; each form's docstring has its loss)."""


def loss_type(name: str) -> LossType:
    """The registry entry of `name`; a name it lacks is a ConfigError naming every one it has."""
    if name not in LOSSES:
        raise ConfigError(
            f"loss.type is {name!r}; allowed: {', '.join(LOSSES)}; set loss.type to one of them "
            '(docs/objective.md, "The loss family")'
        )
    return LOSSES[name]


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
    """Per-pair losses of `config.type`'s closed form (its `LOSSES` entry) from summed completion log-probs,
    and the token counts for the averaged forms."""
    loss = loss_type(config.type)
    counts = None
    if loss.per_token_means or config.average_log_prob:
        counts = chosen_tokens.to(chosen.dtype).clamp(min=1), rejected_tokens.to(chosen.dtype).clamp(min=1)
    if loss.needs_reference:
        if ref_chosen is None or ref_rejected is None:
            raise ConfigError(
                f"loss.type {config.type} needs reference log-probs; set reference.mode to live or precomputed"
            )
        chosen, rejected = chosen - ref_chosen, rejected - ref_rejected
    losses, chosen_rewards, rejected_rewards = loss.form(config, chosen, rejected, counts)
    return PairTerms(losses, chosen_rewards.detach(), rejected_rewards.detach())
