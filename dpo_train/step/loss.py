"""The DPO loss family on per-pair log-probabilities: closed forms, one value per pair, no reduction.

The step, not the loss, reduces: it sums pair losses and divides by the number of pairs in the whole
optimizer step, so every pair weighs the same whatever the packing (docs/objective.md). So every form is a
function of one pair's values, save the `sorted` types (AOT), which pair the step's sorted log-ratios: they
also read each pair's partners in those sorts, constants that dpo_train/step/sort.py finds over the whole
step (every micro-batch and rank) before its forwards, so they too are the same whatever the packing.
Notation: for a pair, c = log pi(chosen), r = log pi(rejected) (summed over completion tokens, or
averaged with `average_log_prob`), c0 and r0 the same under the reference, |c| and |r| completion
token counts, the log-ratios x_c = c - c0 and x_r = r - r0, f the score of `loss.f_divergence_type`
(reverse_kl: f(x) = x), and the margin  D = f(x_c) - f(x_r)  (reverse_kl: the DPO margin).

`LOSSES` is the family: one `LossType` per `loss.type` name, and the only list of them. The per-pair
computation, `LossConfig.needs_reference` and the config's rules (dpo_train/config/rules.py) all read it.
Adding a loss type is one entry here (its closed form in the function's docstring) plus its row in the
docs/objective.md table (tests/train/step/test_loss.py checks the table's facts against the entries); the schema's
`loss_type` enum is generated from `LOSSES` (`python -m dpo_train.config.schema --write`, checked by
tests/train/config/test_config_schema.py). `loss.type` may also be a list of names,
combined per pair as sum_k w_k L_k with `loss.weights`, as TRL 1.16 combines its `loss_type` list.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F

from dpo_train.errors import ConfigError
from dpo_train.keys import WEIGHTS, key

Counts = tuple[torch.Tensor, torch.Tensor]
"""Completion token counts of (chosen, rejected), at least 1, in the log-probs' dtype."""


@dataclass(frozen=True)
class Interval:
    """A range of a number: [low, high], or open at either end (`open_low`, `open_high`)."""

    low: float
    high: float
    open_high: bool = False
    open_low: bool = False

    def __contains__(self, value: float) -> bool:
        above = self.low < value if self.open_low else self.low <= value
        return above and (value < self.high if self.open_high else value <= self.high)

    def __str__(self) -> str:
        return f"{'(' if self.open_low else '['}{self.low:g}, {self.high:g}{')' if self.open_high else ']'}"


Form = Callable[["LossConfig", torch.Tensor, torch.Tensor, Counts | None], tuple[torch.Tensor, ...]]


@dataclass(frozen=True)
class LossType:
    """One member of the loss family: its closed form and every fact the rest of the code asks about it."""

    form: Form
    """(config, chosen, rejected, counts) -> (losses, chosen rewards, rejected rewards), per pair.
    chosen and rejected are the summed log-ratios c - c0 and r - r0 (c and r for a reference-free type);
    counts are the token counts where per-token means apply (the type's or `average_log_prob`), else None.
    The form takes the means itself, so that each keeps its own order of operations. The rewards are b
    times the log-ratios as the form reads them (per-token means where it takes them)."""
    needs_reference: bool = True
    """False: reference-free (reference.mode may be none; reference log-probs are never read)."""
    label_smoothing: Interval | None = None
    """The range `loss.label_smoothing` may take; None: the type has none, and it must be 0."""
    per_token_means: bool = False
    """Always per-token mean log-probs, whatever `loss.average_log_prob` says."""
    f_divergence: bool = False
    """The form reads the log-ratios through their f-divergence scores (TRL 1.16's f_divergence_loss_types,
    less sft); a type that reads the log-ratios themselves refuses any f_divergence_type but reverse_kl."""
    options: tuple[str, ...] = ()
    """The `loss` keys only this type (among the family) reads; each must keep its default unless a listed
    type reads it."""
    nll_term: bool = False
    """The type is the step's NLL on chosen completions (objective.py `microbatch_loss`), not a per-pair
    term: its form adds 0 per pair and `LossConfig.sft_weight` hands its weight to that term."""
    with_nll: bool = False
    """The method's objective adds the step's NLL on chosen completions (CPO's BC term, ORPO's SFT term): the
    config must say that term's weight (sft listed, or nll_weight), so that it is never silently left out."""
    sorted: bool = False
    """The loss pairs the k-th smallest of one log-ratio over the optimizer step with the k-th smallest of
    another (AOT): its form takes a fifth argument, each pair's partners [pairs, 2] in those sorts
    (dpo_train/step/sort.py `step_partners`), constants without gradient."""


def _reverse_kl(config: LossConfig, ratio: torch.Tensor) -> torch.Tensor:
    """f'(t) = log t: the log-ratio itself (DPO)."""
    return ratio


def _forward_kl(config: LossConfig, ratio: torch.Tensor) -> torch.Tensor:
    """f'(t) = 1 - 1/t = 1 - exp(-x) (TRL's; the f-DPO paper's -1/t differs by a constant)."""
    return 1 - torch.exp(-ratio)


def _js_divergence(config: LossConfig, ratio: torch.Tensor) -> torch.Tensor:
    """f'(t) = log(2t / (t + 1)) = log 2 + log s(x)."""
    return math.log(2) + F.logsigmoid(ratio)


def _alpha_divergence(config: LossConfig, ratio: torch.Tensor) -> torch.Tensor:
    """f'(t) = (t^(a-1) - 1) / (a - 1), a = f_alpha_divergence_coef (TRL 1.16's code: the f-DPO paper's
    (1 - t^-alpha) / alpha with alpha = 1 - a); log t within 1e-6 of a = 1, as TRL falls back. (a - 1) x is
    clamped at 80, as TRL clamps it in float32, so exp stays finite (its gradient is 0 beyond)."""
    a = config.f_alpha_divergence_coef
    if abs(a - 1.0) < 1e-6:
        return ratio
    return (torch.exp(torch.clamp((a - 1.0) * ratio, max=80.0)) - 1.0) * (1.0 / (a - 1.0))


F_DIVERGENCES: dict[str, Callable[[LossConfig, torch.Tensor], torch.Tensor]] = {
    "reverse_kl": _reverse_kl,
    "forward_kl": _forward_kl,
    "js_divergence": _js_divergence,
    "alpha_divergence": _alpha_divergence,
}
"""`loss.f_divergence_type` (Wang et al. 2023, "Beyond Reverse KL: Generalizing Direct Preference Optimization
with Diverse Divergence Constraints"): the score f'(t) of a log-ratio x = log t, as TRL 1.16 computes it."""


@dataclass(frozen=True)
class LossConfig:
    """The `loss:` section of the training config; checked by dpo_train/config/rules.py (`config_problems`)
    and the schema, never here."""

    type: str | list[str] = key(
        "sigmoid",
        **{"if": {"type": "string"}},
        then={"$ref": "#/$defs/loss_type"},
        **{"else": {"minItems": 1, "items": {"$ref": "#/$defs/loss_type"}}},
        description="one loss type, or a non-empty list of them combined with loss.weights; docs/objective.md",
    )
    """A name of `LOSSES` (the table in docs/objective.md), or a list of them: per pair the loss is then
    sum_k weights[k] * L_k (TRL's `loss_type` list)."""
    weights: list[float] | None = key(None, **WEIGHTS)
    """With a list `type`: one weight per listed type, each >= 0, in its order. null: 1.0 each."""
    beta: float = key(0.1, exclusiveMinimum=0, maximum=1000)
    """Inverse temperature (IPO: the regularization tau; SimPO, AlphaPO: the reward scale; SPPO: 1 / eta; ORPO:
    the odds-ratio weight lambda, TRL's beta)."""
    label_smoothing: float = key(
        0.0, minimum=0, exclusiveMaximum=1, description="each type's own range is config_problems' (LOSSES)"
    )
    """For the types whose `LOSSES` entry gives it a range (sigmoid: conservative DPO's flip probability;
    robust: the flip probability; exo_pair: the labels' epsilon); 0 for the others."""
    nll_weight: float = key(0.0, minimum=0, maximum=1000)
    """Weight of the NLL on chosen completions (RPO), per supervised chosen token over the whole step; the
    same term as `sft` in a list (with its weight there), so one of the two is 0."""
    average_log_prob: bool = False
    """Use per-token mean log-probs instead of sums (always on for the types whose `LOSSES` entry says
    per_token_means)."""
    target_margin: float = key(0.5, minimum=-1000, maximum=1000)
    """simpo, alphapo: the target reward margin gamma (TRL's `simpo_gamma`)."""
    alpha: float = key(0.0, minimum=-1000, maximum=1000, description="alphapo's reward shape (TRL's alpha)")
    """alphapo, cpo, cpo_hinge, cpo_ipo: the reward shape alpha of u(x) = (1 - exp(-alpha x)) / alpha (TRL's
    CPOTrainer `alpha`, its default 0: u(x) = x; alphapo with 0 is SimPO)."""
    discopop_tau: float = key(0.05, exclusiveMinimum=0, maximum=1000)
    """discopop: the temperature tau of its log-ratio modulation (TRL's default, the paper's)."""
    f_divergence_type: str = key(
        "reverse_kl", enum=tuple(F_DIVERGENCES), description="the names of F_DIVERGENCES in dpo_train/step/loss.py"
    )
    """A name of `F_DIVERGENCES` (f-DPO): the score f each log-ratio goes through for the types that read
    scores (`LossType.f_divergence`); reverse_kl is DPO's f(x) = x."""
    f_alpha_divergence_coef: float = key(0.5, minimum=-1000, maximum=1000)
    """alpha_divergence: TRL's coefficient a of f(x) = (exp((a - 1) x) - 1) / (a - 1)."""
    ld_alpha: float | None = key(None, minimum=0, maximum=1, description="LD-DPO (TRL's ld_alpha); docs/objective.md")
    """LD-DPO (Liu et al. 2024, "Length Desensitization in Direct Preference Optimization"), TRL's `ld_alpha`: per
    pair, the first min(|c|, |r|) tokens of each completion count fully in its summed log-prob (policy and
    reference alike), the rest times ld_alpha, in [0, 1]; null: plain sums (1.0 is the same number)."""
    use_weighting: bool = key(False, description="WPO pair weights (TRL's use_weighting); docs/objective.md")
    """WPO (Zhou et al. 2024, "WPO: Enhancing RLHF with Weighted Preference Optimization"), TRL's `use_weighting`:
    each pair's loss times w_c w_r, w = exp(mean over the completion's tokens of log p(token) - log sum_v
    p(v)^2) under the policy, without gradient (dpo_train/logps/pairs.py `wpo_weights`)."""
    router_aux_coef: float | None = key(None, minimum=0, maximum=1000)
    """Mixture-of-experts models (their config has `output_router_logits`): weight of the router
    load-balancing loss the model returns, added per micro-batch and weighted by its share of the step's
    pairs (docs/objective.md, "MoE"). null: the model config's `router_aux_loss_coef` (0 without one),
    as TRL does; 0 disables it."""

    @property
    def types(self) -> list[str]:
        """`type` as a list of names (one, or the listed ones); an empty list is a ConfigError."""
        if not isinstance(self.type, str) and not self.type:
            raise ConfigError(
                'loss.type is an empty list; name one loss type or more (docs/objective.md, "The loss family")'
            )
        return [self.type] if isinstance(self.type, str) else list(self.type)

    @property
    def type_text(self) -> str:
        """`type` as a message names it: sigmoid, or [sigmoid, bco_pair]."""
        return self.type if isinstance(self.type, str) else f"[{', '.join(map(str, self.type))}]"

    @property
    def members(self) -> list[tuple[str, float]]:
        """(name, weight) of each listed type; 1.0 each without `weights`."""
        weights = [1.0] * len(self.types) if self.weights is None else self.weights
        return list(zip(self.types, weights, strict=True))  # config_problems names a length mismatch first

    @property
    def needs_reference(self) -> bool:
        return any(loss_type(name).needs_reference for name in self.types)

    @property
    def sft_weight(self) -> float:
        """The weight of the step's NLL term on chosen completions (objective.py `microbatch_loss`): the
        listed NLL type's weight (sft), else `nll_weight`; config_problems refuses both at once."""
        listed = [weight for name, weight in self.members if loss_type(name).nll_term]
        return float(listed[0]) if listed else self.nll_weight


def _score(config: LossConfig, ratio: torch.Tensor) -> torch.Tensor:
    return _entry(F_DIVERGENCES, "loss.f_divergence_type", config.f_divergence_type)(config, ratio)


def _of_ratios(loss: Callable[[LossConfig, torch.Tensor, torch.Tensor], torch.Tensor]) -> Form:
    """A form from a closed form of the two log-ratios (per-token means where counts are given); rewards b
    times them."""

    def form(config: LossConfig, chosen: torch.Tensor, rejected: torch.Tensor, counts: Counts | None):
        if counts is not None:
            chosen, rejected = chosen / counts[0], rejected / counts[1]
        return loss(config, chosen, rejected), config.beta * chosen, config.beta * rejected

    return form


def _of_margin(loss: Callable[[LossConfig, torch.Tensor], torch.Tensor]) -> Form:
    """A form from a closed form of the margin D = f(x_c) - f(x_r) alone; rewards b x_c and b x_r."""
    return _of_ratios(lambda config, chosen, rejected: loss(config, _score(config, chosen) - _score(config, rejected)))


def _of_mean_margin(loss: Callable[[LossConfig, torch.Tensor], torch.Tensor]) -> Form:
    """A form from a closed form of the margin of per-token means, D_avg = f(x_c)/|c| - f(x_r)/|r|: TRL 1.16
    divides the score, not the log-ratio (the same under reverse_kl); rewards b x_c/|c| and b x_r/|r|."""

    def form(config: LossConfig, chosen: torch.Tensor, rejected: torch.Tensor, counts: Counts | None):
        (n_c, n_r), b = counts, config.beta
        margin = _score(config, chosen) / n_c - _score(config, rejected) / n_r
        return loss(config, margin), b * (chosen / n_c), b * (rejected / n_r)

    return form


def _smoothed(config: LossConfig, z: torch.Tensor) -> torch.Tensor:
    """-(1 - e) log s(z) - e log s(-z), e = label_smoothing: the logistic loss with flipped labels at rate e."""
    e = config.label_smoothing
    return -(1 - e) * F.logsigmoid(z) - e * F.logsigmoid(-z)


@_of_margin
def _sigmoid(config: LossConfig, margin: torch.Tensor) -> torch.Tensor:
    """DPO (Rafailov et al. 2023): L = -(1 - e) log s(b D) - e log s(-b D)   (e = label_smoothing; e > 0 is
    conservative DPO, which TRL 1.16's sigmoid does not apply: it ignores label_smoothing)."""
    return _smoothed(config, config.beta * margin)


@_of_mean_margin
def _ipo(config: LossConfig, margin: torch.Tensor) -> torch.Tensor:
    """IPO (Azar et al. 2023): L = (D_avg - 1 / (2 b))^2, D_avg of per-token means (as TRL 1.16 normalizes)."""
    return (margin - 1 / (2 * config.beta)) ** 2


@_of_margin
def _hinge(config: LossConfig, margin: torch.Tensor) -> torch.Tensor:
    """SLiC (Zhao et al. 2023): L = max(0, 1 - b D)."""
    return torch.relu(1 - config.beta * margin)


@_of_margin
def _robust(config: LossConfig, margin: torch.Tensor) -> torch.Tensor:
    """Robust DPO (Chowdhury et al. 2024): L = (-(1 - e) log s(b D) + e log s(-b D)) / (1 - 2 e)   (hence e < 0.5)."""
    b, e = config.beta, config.label_smoothing
    return (-(1 - e) * F.logsigmoid(b * margin) + e * F.logsigmoid(-b * margin)) / (1 - 2 * e)


def _simpo(config: LossConfig, chosen: torch.Tensor, rejected: torch.Tensor, counts: Counts | None):
    """SimPO (Meng et al. 2024, "SimPO: Simple Preference Optimization with a Reference-Free Reward"), as TRL
    1.16's CPOTrainer(loss_type="simpo") computes it: with z = b c/|c| - b r/|r| - gamma (gamma = target_margin),
    L = -(1 - e) log s(z) - e log s(-z); no reference; rewards b c/|c| and b r/|r|."""
    (n_c, n_r), b = counts, config.beta
    chosen_reward, rejected_reward = b * chosen / n_c, b * rejected / n_r
    return _smoothed(config, chosen_reward - rejected_reward - config.target_margin), chosen_reward, rejected_reward


def _shaped(config: LossConfig, x: torch.Tensor) -> torch.Tensor:
    """AlphaPO's reward shape (Gupta et al. 2025, "AlphaPO: Reward Shape Matters for LLM Alignment"), TRL 1.16's
    CPOTrainer `alpha` for every CPO loss type: u(x) = (1 - p^-alpha) / alpha = (1 - exp(-alpha x)) / alpha of a
    policy log-prob x = log p; alpha = 0 (TRL's default): u(x) = x, as TRL falls back."""
    a = config.alpha
    return x if a == 0.0 else (1 - torch.exp(-a * x)) / a


def _of_shaped(loss: Callable[[LossConfig, torch.Tensor, torch.Tensor], torch.Tensor]) -> Form:
    """A reference-free CPOTrainer form from the shaped policy log-probs u(c), u(r) (per-token means where
    counts are given); rewards b u(c) and b u(r), CPOTrainer's."""

    def form(config: LossConfig, chosen: torch.Tensor, rejected: torch.Tensor, counts: Counts | None):
        if counts is not None:
            chosen, rejected = chosen / counts[0], rejected / counts[1]
        chosen, rejected = _shaped(config, chosen), _shaped(config, rejected)
        return loss(config, chosen, rejected), config.beta * chosen, config.beta * rejected

    return form


@_of_shaped
def _alphapo(config: LossConfig, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """AlphaPO (Gupta et al. 2025), TRL 1.16's CPOTrainer(loss_type="alphapo"): SimPO on the shaped rewards of
    the per-token means, z = b u(c/|c|) - b u(r/|r|) - gamma (gamma = target_margin; alpha = 0: SimPO),
    L = -(1 - e) log s(z) - e log s(-z)."""
    return _smoothed(config, config.beta * chosen - config.beta * rejected - config.target_margin)


@_of_shaped
def _cpo(config: LossConfig, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """CPO (Xu et al. 2024, "Contrastive Preference Optimization: Pushing the Boundaries of LLM Performance in
    Machine Translation", Eq. 3), TRL 1.16's CPOTrainer(loss_type="sigmoid") on policy log-probs:
    L = -(1 - e) log s(b (u(c) - u(r))) - e log s(-b (u(c) - u(r))); its BC term (TRL's cpo_alpha times the
    chosen NLL) is the step's NLL term (sft, or nll_weight), which `with_nll` asks the config to weigh."""
    return _smoothed(config, config.beta * (chosen - rejected))


@_of_shaped
def _cpo_hinge(config: LossConfig, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """TRL 1.16's CPOTrainer(loss_type="hinge"), SLiC on policy log-probs: L = max(0, 1 - b (u(c) - u(r))),
    with CPO's BC term as `cpo`."""
    return torch.relu(1 - config.beta * (chosen - rejected))


@_of_shaped
def _cpo_ipo(config: LossConfig, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """TRL 1.16's CPOTrainer(loss_type="ipo"), IPO on policy log-probs (per-token means, as CPOTrainer averages
    them for ipo): L = (u(c/|c|) - u(r/|r|) - 1/(2 b))^2, with CPO's BC term as `cpo`."""
    return (chosen - rejected - 1 / (2 * config.beta)) ** 2


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, without cancellation: log(-expm1(x)) near 0, log1p(-exp(x)) below -log 2."""
    return torch.where(x < -math.log(2), torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


@_of_ratios
def _orpo(config: LossConfig, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """ORPO's odds-ratio term (Hong et al. 2024, "ORPO: Monolithic Preference Optimization without Reference
    Model", Eqs. 4 and 7), on the per-token means c/|c|, r/|r| as TRL 1.16's ORPOTrainer takes them: with the
    log odds ratio  l = (c/|c| - r/|r|) - (log(1 - exp(c/|c|)) - log(1 - exp(r/|r|))),  L = -b log s(l), b the
    paper's lambda (TRL's beta); ORPO adds the NLL of the chosen completions (weight 1), the step's NLL term."""
    log_odds = (chosen - rejected) - (_log1mexp(chosen) - _log1mexp(rejected))
    return -config.beta * F.logsigmoid(log_odds)


@_of_margin
def _exo_pair(config: LossConfig, margin: torch.Tensor) -> torch.Tensor:
    """EXO-pref (Ji et al. 2024, "Towards Efficient Exact Optimization of Language Model Alignment"), two
    completions: L = KL(q || p) = q_w (log q_w - log(1 - e)) + q_l (log q_l - log e), q_w = s(b D) and
    q_l = s(-b D) the policy's preference, p = (1 - e, e) the smoothed labels (e = label_smoothing, in (0, 0.5))."""
    b, e = config.beta, config.label_smoothing
    won, lost = b * margin, -b * margin
    return torch.sigmoid(won) * (F.logsigmoid(won) - math.log1p(-e)) + torch.sigmoid(lost) * (
        F.logsigmoid(lost) - math.log(e)
    )


@_of_ratios
def _nca_pair(config: LossConfig, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """NCA (Chen et al. 2024, "Noise Contrastive Alignment of Language Models with Explicit Rewards"), a
    pair: L = -log s(b x_c) - 1/2 log s(-b x_c) - 1/2 log s(-b x_r)."""
    won, lost = config.beta * chosen, config.beta * rejected
    return -F.logsigmoid(won) - 0.5 * F.logsigmoid(-won) - 0.5 * F.logsigmoid(-lost)


@_of_ratios
def _bco_pair(config: LossConfig, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """BCO (Jung et al. 2024, "Binary Classifier Optimization for Large Language Model Alignment") on pairs:
    L = -log s(b x_c) - log s(-b x_r). The paper shifts both rewards by delta, their running mean over
    training; TRL 1.16's code has no shift (delta = 0), and a running mean is a statistic across batches,
    which a per-pair form cannot hold: delta = 0 here too."""
    return -F.logsigmoid(config.beta * chosen) - F.logsigmoid(-config.beta * rejected)


@_of_ratios
def _sppo_hard(config: LossConfig, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """SPPO (Wu et al. 2024, "Self-Play Preference Optimization for Language Model Alignment", Eq. 4.7) with
    hard probabilities (1 for chosen, 0 for rejected): L = (x_c - 1/(2 b))^2 + (x_r + 1/(2 b))^2, the
    paper's eta = 1 / b."""
    return (chosen - 0.5 / config.beta) ** 2 + (rejected + 0.5 / config.beta) ** 2


@_of_ratios
def _apo_zero(config: LossConfig, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """APO-zero (D'Oosterlinck et al. 2024, "Anchored Preference Optimization and Contrastive Revisions",
    Eq. 7): L = (1 - s(b x_c)) + s(b x_r); chosen up, rejected down."""
    return (1 - torch.sigmoid(config.beta * chosen)) + torch.sigmoid(config.beta * rejected)


@_of_ratios
def _apo_down(config: LossConfig, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """APO-down (the same paper, Eq. 8): L = s(b x_c) + (1 - s(b (x_c - x_r))); both down, rejected more."""
    return torch.sigmoid(config.beta * chosen) + (1 - torch.sigmoid(config.beta * (chosen - rejected)))


@_of_margin
def _discopop(config: LossConfig, margin: torch.Tensor) -> torch.Tensor:
    """DiscoPOP's log-ratio modulated loss (Lu et al. 2024, "Discovering Preference Optimization Algorithms
    with and for Large Language Models", Eq. 5): with z = b D and m = s(z / tau) (tau = discopop_tau),
    L = (1 - m) (-log s(z)) + m exp(-z). The term m exp(-z) is taken as exp(-z + log s(z / tau)): the same
    number where TRL's product is finite, and finite (about 0) where TRL's overflows to inf * 0 = NaN
    (z below about -88 in float32)."""
    z = margin * config.beta
    modulation = torch.sigmoid(z / config.discopop_tau)
    return -F.logsigmoid(z) * (1 - modulation) + torch.exp(-z + F.logsigmoid(z / config.discopop_tau))


@_of_ratios
def _sft(config: LossConfig, chosen: torch.Tensor, rejected: torch.Tensor) -> torch.Tensor:
    """SFT: the NLL of the chosen completions per supervised chosen token over the whole step,
    L = -(sum of log p over the step's chosen tokens) / (the step's chosen tokens), times its weight: the
    step's NLL term (objective.py `microbatch_loss`, the term `nll_weight` also sets), not a per-pair
    term, so 0 here; `LossConfig.sft_weight` gives that term its weight."""
    return torch.zeros_like(chosen)


def _aot(config: LossConfig, chosen: torch.Tensor, rejected: torch.Tensor, counts: None, partners: torch.Tensor):
    """AOT, paired (Melnyk et al. 2024, "Distributional Preference Alignment of LLMs via Optimal Transport"), as
    TRL 1.16 computes it: sort the policy margins x = c - r and the reference margins y = c0 - r0 over the
    optimizer step, each on its own, and L = sum_k l(b (x_(k) - y_(k))), l the smoothed logistic loss
    -(1 - e) log s(z) - e log s(-z). The pair whose x is k-th smallest carries term k: with its shift
    s = y - y_(k) (partners[:, 0]), x - y_(k) = (x_c - x_r) + s; s = 0 where the policy orders the step's
    pairs as the reference does (at the start). Rewards b x_c and b x_r."""
    shift = partners[:, 0].to(chosen)
    return _smoothed(config, config.beta * (chosen - rejected + shift)), config.beta * chosen, config.beta * rejected


def _aot_unpaired(
    config: LossConfig, chosen: torch.Tensor, rejected: torch.Tensor, counts: None, partners: torch.Tensor
):
    """AOT, unpaired (the same paper), as TRL 1.16 computes it: sort the chosen log-ratios x_c and the rejected
    x_r over the step, each on its own, and L = sum_k l(b (x_c(k) - x_r(k))). Each sorted term holds two
    pairs' log-ratios, both with gradient: per pair, l(b (x_c - P)) carries its chosen side (P = partners[:, 0],
    the x_r of x_c's rank), and l(b (Q - x_r)) less its own value its rejected side (Q = partners[:, 1], the
    x_c of x_r's rank). Summed over the step: the sorted sum, and its gradient. Rewards b x_c and b x_r."""
    lead, trail = partners[:, 0].to(chosen), partners[:, 1].to(chosen)
    rejected_side = _smoothed(config, config.beta * (trail - rejected))
    losses = _smoothed(config, config.beta * (chosen - lead)) + (rejected_side - rejected_side.detach())
    return losses, config.beta * chosen, config.beta * rejected


@_of_mean_margin
def _sigmoid_norm(config: LossConfig, margin: torch.Tensor) -> torch.Tensor:
    """Length-normalized DPO (the SimPO paper's, Meng et al. 2024, "SimPO: Simple Preference Optimization with
    a Reference-Free Reward", as TRL's docs cite it), with the reference: L = -log s(b D_avg), D_avg of
    per-token means."""
    return -F.logsigmoid(config.beta * margin)


SMOOTHING = Interval(0.0, 0.5, open_high=True)
"""loss.label_smoothing's range for every type that reads it (exo_pair's excludes 0 too): e is the chance that a
pair's labels are flipped, so at 0.5 chosen and rejected weigh the same and the gradient vanishes at parity (the
policy still the reference), and above it every preference is flipped (TRL: [0, 0.5) for robust DPO and cDPO)."""

LOSSES: dict[str, LossType] = {
    "sigmoid": LossType(_sigmoid, label_smoothing=SMOOTHING, f_divergence=True),
    "ipo": LossType(_ipo, per_token_means=True, f_divergence=True),
    "hinge": LossType(_hinge, f_divergence=True),
    "robust": LossType(_robust, label_smoothing=SMOOTHING, f_divergence=True),
    "simpo": LossType(
        _simpo,
        needs_reference=False,
        label_smoothing=SMOOTHING,
        per_token_means=True,
        options=("target_margin",),
    ),
    "exo_pair": LossType(
        _exo_pair, label_smoothing=Interval(0.0, 0.5, open_high=True, open_low=True), f_divergence=True
    ),
    "nca_pair": LossType(_nca_pair),
    "bco_pair": LossType(_bco_pair),
    "sppo_hard": LossType(_sppo_hard),
    "apo_zero": LossType(_apo_zero),
    "apo_down": LossType(_apo_down),
    "discopop": LossType(_discopop, f_divergence=True, options=("discopop_tau",)),
    "sft": LossType(_sft, needs_reference=False, nll_term=True),
    "sigmoid_norm": LossType(_sigmoid_norm, per_token_means=True, f_divergence=True),
    "cpo": LossType(_cpo, needs_reference=False, label_smoothing=SMOOTHING, options=("alpha",), with_nll=True),
    "alphapo": LossType(
        _alphapo,
        needs_reference=False,
        label_smoothing=SMOOTHING,
        per_token_means=True,
        options=("target_margin", "alpha"),
    ),
    "orpo": LossType(_orpo, needs_reference=False, per_token_means=True, with_nll=True),
    "cpo_hinge": LossType(_cpo_hinge, needs_reference=False, options=("alpha",), with_nll=True),
    "cpo_ipo": LossType(_cpo_ipo, needs_reference=False, per_token_means=True, options=("alpha",), with_nll=True),
    "aot": LossType(_aot, label_smoothing=SMOOTHING, sorted=True),
    "aot_unpaired": LossType(_aot_unpaired, label_smoothing=SMOOTHING, sorted=True),
}
"""The loss family, by `loss.type` name (s is the logistic function; each form's docstring has its loss)."""


def _entry(registry: dict, key: str, name: str):
    """`registry[name]`; a name it lacks is a ConfigError naming `key` and every name it has."""
    if name not in registry:
        raise ConfigError(
            f"{key} is {name!r}; allowed: {', '.join(registry)}; set {key} to one of them "
            '(docs/objective.md, "The loss family")'
        )
    return registry[name]


def loss_type(name: str, key: str = "loss.type") -> LossType:
    """The registry entry of `name` (`key`: where the config names it, e.g. loss.type[1] in a list)."""
    return _entry(LOSSES, key, name)


@dataclass
class PairTerms:
    """Per-pair values: the loss and the implicit rewards (for metrics)."""

    losses: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor


class Scored(Protocol):
    """A model's log-probs of a micro-batch's pairs, as the loss reads them (the reference's: `ReferenceLogps`,
    dpo_train/reference/choice.py)."""

    @property
    def scored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(chosen, rejected) [pairs]: the summed completion log-probs, LD-DPO's sums with `ld_alpha`."""
        ...


class PolicyScored(Scored, Protocol):
    """The policy's log-probs, as the loss reads them (`PairLogps`, what `pair_logps` returns): also each pair's
    completion token counts, and WPO's weights where asked for (`use_weighting`), without gradient."""

    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    weights: torch.Tensor | None


def pair_losses(
    policy: PolicyScored,
    reference: Scored | None,
    config: LossConfig,
    partners: dict[str, torch.Tensor] | None = None,
) -> PairTerms:
    """Per-pair losses of `config.type` (each listed type's closed form, its `LOSSES` entry, weighted and
    summed) from the policy's and the reference's log-probs (`scored`; `reference` None for a reference-free
    loss), and the policy's token counts for the averaged forms. The policy's `weights`: WPO's (`use_weighting`),
    multiplying each pair's loss, as TRL multiplies each listed type's. `partners`: each listed `sorted` type's
    partners of these pairs in the step's sorts (dpo_train/step/sort.py). The rewards are the first listed type's
    that has a per-pair term (not sft's, unless it is alone)."""
    pair_weights = policy.weights
    if config.use_weighting and pair_weights is None:
        raise ConfigError(
            "loss.use_weighting is true, but the policy's log-probs carry no WPO weights; score the policy with "
            "pair_logps(..., weighting=True)"
        )
    unpartnered = [name for name in config.types if loss_type(name).sorted and name not in (partners or {})]
    if unpartnered:
        raise ConfigError(
            f"loss.type {unpartnered[0]} pairs the optimizer step's sorted log-ratios, and no partners reached "
            "the loss; pass partners from dpo_train/step/sort.py `step_partners` over the whole step"
        )
    if config.needs_reference and reference is None:
        raise ConfigError(
            f"loss.type {config.type_text} needs reference log-probs; set reference.mode to live or precomputed"
        )
    chosen, rejected = policy.scored
    ref_chosen, ref_rejected = reference.scored if reference is not None else (None, None)
    counts = policy.chosen_tokens.to(chosen.dtype).clamp(min=1), policy.rejected_tokens.to(chosen.dtype).clamp(min=1)
    members = config.members
    rewarding = next((name for name, _ in members if not loss_type(name).nll_term), members[0][0])
    total = 0.0
    for name, weight in members:
        kind = loss_type(name)
        pair = (chosen - ref_chosen, rejected - ref_rejected) if kind.needs_reference else (chosen, rejected)
        means = counts if kind.per_token_means or config.average_log_prob else None
        extra = (partners[name],) if kind.sorted else ()
        losses, *rewards = kind.form(config, *pair, means, *extra)
        if config.use_weighting:
            losses = losses * pair_weights
        total = total + weight * losses  # weight 1.0 (one type) leaves the losses bit for bit
        if name == rewarding:
            chosen_rewards, rejected_rewards = rewards
    return PairTerms(total, chosen_rewards.detach(), rejected_rewards.detach())
