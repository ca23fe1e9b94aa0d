"""Loss family: each closed form on hand-sized tensors against an independent scalar reference."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from dpo_train.errors import ConfigError
from dpo_train.logps.pairs import PairLogps
from dpo_train.logps.scoring import Scoring
from dpo_train.reference.choice import ReferenceLogps
from dpo_train.step.loss import F_DIVERGENCES, LOSSES, LossConfig, LossType, pair_losses
from dpo_train.step.objective import microbatch_loss

# Three pairs: summed completion log-probs under the policy and the reference, and token counts.
C, R = torch.tensor([-10.0, -4.0, -7.5]), torch.tensor([-12.0, -3.0, -7.5])
C0, R0 = torch.tensor([-11.0, -4.5, -7.0]), torch.tensor([-11.0, -3.5, -8.0])
NC, NR = torch.tensor([5, 2, 3]), torch.tensor([4, 1, 3])
POLICY, REFERENCE = PairLogps(C, R, NC, NR), ReferenceLogps(C0, R0)
TOL = dict(rtol=1e-6, atol=1e-6)


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return math.exp(log_sigmoid(x))


def ratios(avg=False):
    """Per pair (x_c, x_r): the log-ratios, per-token means with avg."""
    out = []
    for c, r, c0, r0, nc, nr in zip(C.tolist(), R.tolist(), C0.tolist(), R0.tolist(), NC.tolist(), NR.tolist()):
        out.append(((c - c0) / nc, (r - r0) / nr) if avg else (c - c0, r - r0))
    return out


def margins(avg=False):
    return [x_c - x_r for x_c, x_r in ratios(avg)]


def losses(**config):
    return pair_losses(POLICY, REFERENCE, LossConfig(**config))


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.5])
def test_sigmoid_and_conservative_dpo(eps):
    """L = -(1 - e) log s(b D) - e log s(-b D)."""
    b = 0.3
    expected = [-(1 - eps) * log_sigmoid(b * d) - eps * log_sigmoid(-b * d) for d in margins()]
    torch.testing.assert_close(
        losses(type="sigmoid", beta=b, label_smoothing=eps).losses, torch.tensor(expected), **TOL
    )


def test_sigmoid_is_log2_when_policy_equals_reference():
    out = pair_losses(POLICY, ReferenceLogps(C, R), LossConfig())
    torch.testing.assert_close(out.losses, torch.full((3,), math.log(2)), **TOL)


def test_ipo_uses_per_token_means():
    """L = (D_avg - 1 / (2 b))^2."""
    b = 0.5
    expected = [(d - 1 / (2 * b)) ** 2 for d in margins(avg=True)]
    torch.testing.assert_close(losses(type="ipo", beta=b).losses, torch.tensor(expected), **TOL)


def test_hinge():
    """L = max(0, 1 - b D)."""
    b = 0.4
    expected = [max(0.0, 1 - b * d) for d in margins()]
    torch.testing.assert_close(losses(type="hinge", beta=b).losses, torch.tensor(expected), **TOL)


def test_robust():
    """L = (-(1 - e) log s(b D) + e log s(-b D)) / (1 - 2 e)."""
    b, e = 0.2, 0.2
    expected = [(-(1 - e) * log_sigmoid(b * d) + e * log_sigmoid(-b * d)) / (1 - 2 * e) for d in margins()]
    torch.testing.assert_close(losses(type="robust", beta=b, label_smoothing=e).losses, torch.tensor(expected), **TOL)


def test_simpo_is_reference_free_and_length_normalized():
    """L = -log s(b (c/|c| - r/|r|) - gamma)."""
    b, g = 2.0, 0.5
    expected = [
        -log_sigmoid(b * (c / nc - r / nr) - g)
        for c, r, nc, nr in zip(C.tolist(), R.tolist(), NC.tolist(), NR.tolist())
    ]
    out = pair_losses(POLICY, None, LossConfig(type="simpo", beta=b, target_margin=g))
    torch.testing.assert_close(out.losses, torch.tensor(expected), **TOL)


def test_rewards_are_beta_times_log_ratios():
    out = losses(type="sigmoid", beta=0.1)
    torch.testing.assert_close(out.chosen_rewards, 0.1 * (C - C0), **TOL)
    torch.testing.assert_close(out.rejected_rewards, 0.1 * (R - R0), **TOL)


def test_average_log_prob_divides_by_token_counts():
    b = 0.3
    expected = [-log_sigmoid(b * d) for d in margins(avg=True)]
    torch.testing.assert_close(
        losses(type="sigmoid", beta=b, average_log_prob=True).losses, torch.tensor(expected), **TOL
    )


# -- TRL 1.16's further types: each closed form against scalar math (x_c, x_r the log-ratios) --

CLOSED_FORMS = {
    "exo_pair": (
        dict(beta=0.3, label_smoothing=0.01),
        lambda x_c, x_r, b, e: (
            sigmoid(b * (x_c - x_r)) * (log_sigmoid(b * (x_c - x_r)) - math.log(1 - e))
            + sigmoid(-b * (x_c - x_r)) * (log_sigmoid(-b * (x_c - x_r)) - math.log(e))
        ),
    ),
    "nca_pair": (
        dict(beta=0.4),
        lambda x_c, x_r, b, e: -log_sigmoid(b * x_c) - 0.5 * log_sigmoid(-b * x_c) - 0.5 * log_sigmoid(-b * x_r),
    ),
    "bco_pair": (dict(beta=0.4), lambda x_c, x_r, b, e: -log_sigmoid(b * x_c) - log_sigmoid(-b * x_r)),
    "sppo_hard": (dict(beta=0.5), lambda x_c, x_r, b, e: (x_c - 0.5 / b) ** 2 + (x_r + 0.5 / b) ** 2),
    "apo_zero": (dict(beta=0.7), lambda x_c, x_r, b, e: 1 - sigmoid(b * x_c) + sigmoid(b * x_r)),
    "apo_down": (dict(beta=0.7), lambda x_c, x_r, b, e: sigmoid(b * x_c) + 1 - sigmoid(b * (x_c - x_r))),
    "discopop": (
        dict(beta=0.3, discopop_tau=0.2),
        lambda x_c, x_r, b, e: (
            (1 - sigmoid(b * (x_c - x_r) / 0.2)) * -log_sigmoid(b * (x_c - x_r))
            + sigmoid(b * (x_c - x_r) / 0.2) * math.exp(-b * (x_c - x_r))
        ),
    ),
}


@pytest.mark.parametrize("name", list(CLOSED_FORMS))
def test_each_further_type_is_its_closed_form(name):
    """exo_pair, nca_pair, bco_pair, sppo_hard, apo_zero, apo_down, discopop: the docstrings' formulas, with
    the rewards b x_c and b x_r (TRL's, and the DPO types')."""
    config, closed_form = CLOSED_FORMS[name]
    b, e = config["beta"], config.get("label_smoothing", 0.0)
    out = losses(type=name, **config)
    torch.testing.assert_close(out.losses, torch.tensor([closed_form(x_c, x_r, b, e) for x_c, x_r in ratios()]), **TOL)
    torch.testing.assert_close(out.chosen_rewards, b * (C - C0), **TOL)
    torch.testing.assert_close(out.rejected_rewards, b * (R - R0), **TOL)


def test_sigmoid_norm_uses_per_token_means():
    """L = -log s(b D_avg), as IPO normalizes; rewards of the per-token means."""
    b = 2.0
    out = losses(type="sigmoid_norm", beta=b, average_log_prob=False)
    torch.testing.assert_close(out.losses, torch.tensor([-log_sigmoid(b * d) for d in margins(avg=True)]), **TOL)
    torch.testing.assert_close(out.chosen_rewards, b * (C - C0) / NC, **TOL)


def test_discopop_stays_finite_where_the_literal_product_overflows():
    """At z = b D = -200, m exp(-z) is exp(200) * s(-4000): inf * 0 = NaN as TRL writes it (float32); the loss
    there is -log s(-200) = 200 within rounding, the exponential term about 0."""
    one = torch.ones(1, dtype=torch.long)
    policy = PairLogps(torch.tensor([-200.0]), torch.tensor([0.0]), one, one)
    out = pair_losses(policy, ReferenceLogps(torch.zeros(1), torch.zeros(1)), LossConfig(type="discopop", beta=1.0))
    torch.testing.assert_close(out.losses, torch.tensor([200.0]), rtol=1e-6, atol=0)
    z = torch.tensor(-200.0)
    assert torch.isnan(torch.exp(-z) * torch.sigmoid(z / 0.05))  # the product this form avoids


def test_sft_adds_nothing_per_pair_and_hands_its_weight_to_the_nll_term():
    """sft is the step's NLL term (objective.py): 0 per pair, its weight `sft_weight`; without it the weight
    is nll_weight. Alone it reads no reference, and its rewards are b c, b r."""
    out = pair_losses(POLICY, None, LossConfig(type="sft"))
    assert out.losses.tolist() == [0.0, 0.0, 0.0]
    torch.testing.assert_close(out.chosen_rewards, 0.1 * C, **TOL)
    assert LossConfig(type="sft").needs_reference is False
    assert (LossConfig(type="sft").sft_weight, LossConfig(type=["sft"], weights=[0.4]).sft_weight) == (1.0, 0.4)
    assert (
        LossConfig(nll_weight=0.3).sft_weight,
        LossConfig(type=["sigmoid", "sft"], weights=[1.0, 0.0]).sft_weight,
    ) == (
        0.3,
        0.0,
    )


# -- f-divergences (f-DPO): the score f of each log-ratio, for the types that read scores --

SCORES = {
    "reverse_kl": lambda x: x,
    "forward_kl": lambda x: 1 - math.exp(-x),
    "js_divergence": lambda x: math.log(2) + log_sigmoid(x),
    "alpha_divergence": lambda x: (math.exp((0.3 - 1) * x) - 1) / (0.3 - 1),
}


@pytest.mark.parametrize("divergence", list(F_DIVERGENCES))
def test_sigmoid_reads_each_f_divergences_scores(divergence):
    """L = -log s(b (f(x_c) - f(x_r))); the rewards stay b x_c, b x_r (TRL logs the log-ratios, not scores)."""
    b, f = 0.3, SCORES[divergence]
    out = losses(type="sigmoid", beta=b, f_divergence_type=divergence, f_alpha_divergence_coef=0.3)
    expected = [-log_sigmoid(b * (f(x_c) - f(x_r))) for x_c, x_r in ratios()]
    torch.testing.assert_close(out.losses, torch.tensor(expected), **TOL)
    torch.testing.assert_close(out.chosen_rewards, b * (C - C0), **TOL)


@pytest.mark.parametrize("name", ["ipo", "sigmoid_norm"])
def test_the_per_token_types_divide_the_score_not_the_log_ratio(name):
    """TRL 1.16 takes f(x_c) / |c|, not f(x_c / |c|): under forward_kl the two differ."""
    b, f = 0.5, SCORES["forward_kl"]
    out = losses(type=name, beta=b, f_divergence_type="forward_kl")
    closed = {"ipo": lambda d: (d - 1 / (2 * b)) ** 2, "sigmoid_norm": lambda d: -log_sigmoid(b * d)}[name]
    expected = [closed(f(x_c) / nc - f(x_r) / nr) for (x_c, x_r), nc, nr in zip(ratios(), NC.tolist(), NR.tolist())]
    torch.testing.assert_close(out.losses, torch.tensor(expected), **TOL)


def test_alpha_divergence_falls_back_to_reverse_kl_at_1_and_clamps_like_trl():
    """At a = 1 the score is log t (reverse_kl) exactly; (a - 1) x is clamped at 80, so exp stays finite."""
    reverse = losses(type="hinge", beta=0.4)
    at_one = losses(type="hinge", beta=0.4, f_divergence_type="alpha_divergence", f_alpha_divergence_coef=1.0)
    torch.testing.assert_close(at_one.losses, reverse.losses, rtol=0, atol=0)
    ratio = torch.tensor([-1000.0])  # (0.1 - 1) * -1000 = 900, clamped to 80
    config = LossConfig(type="hinge", beta=1.0, f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.1)
    zero = torch.zeros(1)
    out = pair_losses(PairLogps(ratio, zero, NC[:1], NR[:1]), ReferenceLogps(zero, zero), config)
    score = (math.exp(80.0) - 1) / (0.1 - 1)
    torch.testing.assert_close(out.losses, torch.tensor([max(0.0, 1 - score)]), rtol=1e-6, atol=0)


# -- a list of types: per pair sum_k w_k L_k, as TRL combines its loss_type list --


def test_a_list_is_the_weighted_sum_of_its_types_and_logs_the_first_types_rewards():
    """[sigmoid, bco_pair, sft] with [0.8, 0.2, 1.0] (the MPO mix in TRL's docs): per pair 0.8 sigmoid +
    0.2 bco_pair, sigmoid's rewards; sft's weight goes to the NLL term, so the step loss adds
    1.0 * chosen NLL per chosen token."""
    config = LossConfig(type=["sigmoid", "bco_pair", "sft"], weights=[0.8, 0.2, 1.0], beta=0.3)
    out = pair_losses(POLICY, REFERENCE, config)
    sigmoid_, bco = losses(type="sigmoid", beta=0.3), losses(type="bco_pair", beta=0.3)
    torch.testing.assert_close(out.losses, 0.8 * sigmoid_.losses + 0.2 * bco.losses, rtol=0, atol=0)
    torch.testing.assert_close(out.chosen_rewards, sigmoid_.chosen_rewards, rtol=0, atol=0)
    assert config.needs_reference and config.sft_weight == 1.0
    step = microbatch_loss(out.losses, 3, -C.sum(), float(NC.sum()), config.sft_weight)
    expected = (0.8 * sigmoid_.losses + 0.2 * bco.losses).mean() + -C.sum() / NC.sum()
    torch.testing.assert_close(step, expected, **TOL)


def test_a_lists_weights_default_to_one_and_its_rewards_skip_sft():
    """Without weights each type counts 1.0; a list that starts with sft logs the next type's rewards."""
    out = pair_losses(POLICY, REFERENCE, LossConfig(type=["sft", "hinge", "ipo"], beta=0.4))
    hinge, ipo = losses(type="hinge", beta=0.4), losses(type="ipo", beta=0.4)
    torch.testing.assert_close(out.losses, hinge.losses + ipo.losses, rtol=0, atol=0)
    torch.testing.assert_close(out.chosen_rewards, hinge.chosen_rewards, rtol=0, atol=0)


def test_a_list_needs_a_reference_if_any_of_its_types_does():
    free = LossConfig(type=["simpo", "sft"], beta=2.0)
    assert free.needs_reference is False
    out = pair_losses(POLICY, None, free)  # no reference read
    torch.testing.assert_close(out.losses, pair_losses(POLICY, None, LossConfig(type="simpo", beta=2.0)).losses)
    mixed = LossConfig(type=["simpo", "sigmoid"])
    assert mixed.needs_reference is True
    with pytest.raises(ConfigError, match=r"loss.type \[simpo, sigmoid\] needs reference log-probs"):
        pair_losses(POLICY, None, mixed)


def _configs():
    """Every type alone, under each f-divergence it takes."""
    for name, kind in LOSSES.items():
        smoothing = 0.01 if name == "exo_pair" else 0.0
        for divergence in F_DIVERGENCES if kind.f_divergence else ["reverse_kl"]:
            yield pytest.param(
                LossConfig(type=name, label_smoothing=smoothing, f_divergence_type=divergence),
                id=f"{name}-{divergence}",
            )


@pytest.mark.parametrize("config", list(_configs()))
def test_every_pairs_loss_is_a_function_of_that_pair_alone(config):
    """The step divides the sum of pair losses by the step's pairs (docs/objective.md), so a pair's loss may
    not depend on the other pairs of its micro-batch (no batch mean, no sort): each pair alone, and the pairs
    in reverse order, give the same per-pair values. A sorted type (AOT) reads the step's sorts through its
    partners, constants given with the pair (tests/train/step/test_step_sort.py): with them, the same holds."""
    partners = torch.linspace(-1.0, 2.0, 2 * len(C), dtype=C.dtype).reshape(len(C), 2)

    def losses(index):
        found = {name: partners[index] for name in config.types if LOSSES[name].sorted}
        policy = PairLogps(C[index], R[index], NC[index], NR[index])
        return pair_losses(policy, ReferenceLogps(C0[index], R0[index]), config, partners=found)

    whole = losses(torch.arange(len(C)))
    for i in range(len(C)):
        one = losses(torch.arange(i, i + 1))
        torch.testing.assert_close(one.losses, whole.losses[i : i + 1], **TOL)
        torch.testing.assert_close(one.chosen_rewards, whole.chosen_rewards[i : i + 1], **TOL)
    flip = torch.arange(len(C) - 1, -1, -1)
    torch.testing.assert_close(losses(flip).losses, whole.losses[flip], **TOL)


def test_a_loss_type_is_one_registry_entry(monkeypatch):
    """The per-pair computation and `needs_reference` read `LOSSES` alone: an entry added there is computed,
    its form given the token counts because it asks for per-token means, and no reference because it
    needs none (the config's checks read the same entry: tests/train/config/test_config.py)."""
    given = []

    def form(config, chosen, rejected, counts):
        given.append(counts)
        return chosen / counts[0] - rejected / counts[1], chosen, rejected

    monkeypatch.setitem(LOSSES, "mean_gap", LossType(form, needs_reference=False, per_token_means=True))
    config = LossConfig(type="mean_gap")
    assert config.needs_reference is False and LossConfig(type="sigmoid").needs_reference is True
    out = pair_losses(POLICY, None, config)
    torch.testing.assert_close(out.losses, C / NC - R / NR, rtol=0, atol=0)
    assert [c.tolist() for c in given[0]] == [NC.float().tolist(), NR.float().tolist()]


def test_an_unknown_loss_type_is_named_with_the_registrys_names():
    with pytest.raises(ConfigError) as info:
        pair_losses(POLICY, REFERENCE, LossConfig(type="kto"))
    assert str(info.value).startswith(f"loss.type is 'kto'; allowed: {', '.join(LOSSES)}; set loss.type to one")


def test_reference_losses_refuse_a_missing_reference():
    with pytest.raises(ConfigError, match="needs reference log-probs"):
        pair_losses(POLICY, None, LossConfig())


def test_the_docs_loss_table_is_the_registry():
    """docs/objective.md's table states each type's facts; they must be its `LOSSES` entry's, row for row."""
    text = (Path(__file__).resolve().parents[3] / "docs" / "objective.md").read_text()
    table = text.split("| `loss.type` | per-pair loss | reference |")[1].split("\n\n")[0].splitlines()[2:]
    rows = [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in table]
    documented = {row[0].strip("`"): tuple(row[2:7]) for row in rows}
    assert documented == {
        name: (
            "needed" if kind.needs_reference else "none",
            str(kind.label_smoothing) if kind.label_smoothing else "none",
            "always" if kind.per_token_means else "never" if kind.sorted else "with `average_log_prob`",
            "yes" if kind.f_divergence else "no",
            ", ".join(f"`{option}`" for option in kind.options) or "none",
        )
        for name, kind in LOSSES.items()
    }


def test_the_trainer_gives_sft_in_a_list_to_the_nll_term(sample_dataset):
    """The trainer's one reading of the NLL weight is `sft_weight`: [sigmoid, sft] with sft's weight 0.7 takes
    the gradient of sigmoid with nll_weight 0.7, and not sigmoid's alone."""
    from dpo_data.dataset.store import PairStore
    from dpo_data.loading.microbatch import pack_microbatch
    from tests.harness import TINY_LLAMA, tiny_trainer

    store = PairStore([str(sample_dataset)])
    pairs = [store.pair(i) for i in range(4)]

    def gradient(**loss):
        config = {
            "model": {"init": {"config": TINY_LLAMA, "seed": 0}},
            "data": {"path": str(sample_dataset)},
            "loss": loss,
            "train": {"output_dir": "unused"},
            "distributed": {"device": "cpu"},
        }
        trainer = tiny_trainer(config, store=store)
        batch = pack_microbatch(pairs, pad_to_multiple_of=8)
        batch.update(
            microbatch=0, microbatches_in_step=1, step_pairs=4, step_chosen_tokens=sum(len(p.chosen) for p in pairs)
        )
        trainer.microbatch(batch)
        return torch.cat([p.grad.flatten() for p in trainer.policy.parameters()])

    listed = gradient(type=["sigmoid", "sft"], weights=[1.0, 0.7])
    torch.testing.assert_close(listed, gradient(type="sigmoid", nll_weight=0.7), rtol=1e-6, atol=1e-9)
    assert not torch.allclose(listed, gradient(type="sigmoid"), rtol=1e-3, atol=0)


# -- the reference-free methods (TRL 1.16's CPO and ORPO trainers): policy log-probs c, r alone --

REFERENCE_FREE = {
    "cpo": (
        dict(beta=0.3, label_smoothing=0.2),
        lambda c, r, nc, nr: -0.8 * log_sigmoid(0.3 * (c - r)) - 0.2 * log_sigmoid(-0.3 * (c - r)),
        lambda c, nc: 0.3 * c,
    ),
    "simpo": (
        dict(beta=2.0, target_margin=0.4, label_smoothing=0.1),
        lambda c, r, nc, nr: (
            -0.9 * log_sigmoid(2.0 * (c / nc - r / nr) - 0.4) - 0.1 * log_sigmoid(-(2.0 * (c / nc - r / nr) - 0.4))
        ),
        lambda c, nc: 2.0 * c / nc,
    ),
    "alphapo": (
        dict(beta=2.0, alpha=0.5, target_margin=0.3),
        lambda c, r, nc, nr: (
            -log_sigmoid(2.0 * (1 - math.exp(-0.5 * c / nc)) / 0.5 - 2.0 * (1 - math.exp(-0.5 * r / nr)) / 0.5 - 0.3)
        ),
        lambda c, nc: 2.0 * (1 - math.exp(-0.5 * c / nc)) / 0.5,
    ),
    "orpo": (
        dict(beta=0.5),
        lambda c, r, nc, nr: (
            -0.5
            * log_sigmoid(
                math.log((math.exp(c / nc) / (1 - math.exp(c / nc))) / (math.exp(r / nr) / (1 - math.exp(r / nr))))
            )
        ),
        lambda c, nc: 0.5 * c / nc,
    ),
    "cpo_hinge": (
        dict(beta=0.3, alpha=0.05),
        lambda c, r, nc, nr: max(0.0, 1 - 0.3 * ((1 - math.exp(-0.05 * c)) / 0.05 - (1 - math.exp(-0.05 * r)) / 0.05)),
        lambda c, nc: 0.3 * (1 - math.exp(-0.05 * c)) / 0.05,
    ),
    "cpo_ipo": (
        dict(beta=0.5),
        lambda c, r, nc, nr: (c / nc - r / nr - 1 / (2 * 0.5)) ** 2,
        lambda c, nc: 0.5 * c / nc,
    ),
}


@pytest.mark.parametrize("name", list(REFERENCE_FREE))
def test_each_reference_free_method_is_its_closed_form_on_policy_log_probs(name):
    """cpo and cpo_hinge sum, simpo, alphapo, cpo_ipo and orpo take per-token means (orpo: the odds p / (1 - p)
    of the mean log-prob, as its paper writes them); none reads a reference. Rewards: b times what the form
    reads (alphapo, and the CPO types with alpha: the shaped reward)."""
    config, closed_form, reward = REFERENCE_FREE[name]
    out = pair_losses(POLICY, None, LossConfig(type=name, **config))
    rows = list(zip(C.tolist(), R.tolist(), NC.tolist(), NR.tolist()))
    torch.testing.assert_close(out.losses, torch.tensor([closed_form(*row) for row in rows]), **TOL)
    torch.testing.assert_close(out.chosen_rewards, torch.tensor([reward(c, nc) for c, _, nc, _ in rows]), **TOL)
    torch.testing.assert_close(out.rejected_rewards, torch.tensor([reward(r, nr) for _, r, _, nr in rows]), **TOL)
    assert LOSSES[name].needs_reference is False


def test_alphapo_at_alpha_0_is_simpo_and_orpo_is_finite_near_probability_1():
    """alpha = 0 falls back to r(x) = x (TRL's), bit for bit SimPO; orpo's log(1 - exp(x)) keeps its digits for a
    mean log-prob near 0, where log1p(-exp(x)) would lose them."""
    simpo = pair_losses(POLICY, None, LossConfig(type="simpo", beta=2.0)).losses
    alphapo = pair_losses(POLICY, None, LossConfig(type="alphapo", beta=2.0)).losses
    torch.testing.assert_close(alphapo, simpo, rtol=0, atol=0)
    near, far, one = (
        torch.tensor([-1e-12], dtype=torch.float64),
        torch.tensor([-2.0], dtype=torch.float64),
        torch.ones(1),
    )
    out = pair_losses(PairLogps(near, far, one, one), None, LossConfig(type="orpo", beta=1.0))
    expected = -log_sigmoid((-1e-12 + 2.0) - (math.log(-math.expm1(-1e-12)) - math.log(-math.expm1(-2.0))))
    assert out.losses.item() == pytest.approx(expected, rel=1e-9, abs=0)


# -- LD-DPO (ld_alpha) and WPO (use_weighting): the per-token options reach the loss --


def test_wpo_weights_multiply_each_pairs_loss_and_are_required_when_on():
    weights = torch.tensor([0.5, 2.0, 0.25])
    config = LossConfig(type=["sigmoid", "bco_pair"], weights=[0.8, 0.2], beta=0.3, use_weighting=True)
    out = pair_losses(PairLogps(C, R, NC, NR, weights=weights), REFERENCE, config)
    plain = pair_losses(POLICY, REFERENCE, LossConfig(type=["sigmoid", "bco_pair"], weights=[0.8, 0.2], beta=0.3))
    torch.testing.assert_close(out.losses, plain.losses * weights, **TOL)
    torch.testing.assert_close(out.chosen_rewards, plain.chosen_rewards, rtol=0, atol=0)  # rewards are not weighted
    with pytest.raises(ConfigError, match="use_weighting is true, but the policy.s log-probs carry no WPO weights"):
        pair_losses(POLICY, REFERENCE, config)


def test_the_trainer_feeds_ld_sums_of_policy_and_reference_and_wpo_weights_to_the_loss(sample_dataset):
    """trainer.microbatch's gradient is the one of the loss on the policy's and the live reference's LD-DPO
    sums with the policy's WPO weights (at step 0 the two models agree, so the gradient is that of the LD
    sums, and none flows through the weights); ld_alpha 1.0 and no weighting give the plain gradient, and
    ld_alpha 0.3 or weighting alone do not."""
    from dpo_data.dataset.store import PairIds, PairStore
    from dpo_data.loading.microbatch import pack_microbatch
    from dpo_train.logps.pairs import pair_logps
    from tests.harness import TINY_LLAMA, tiny_trainer

    store = PairStore([str(sample_dataset)])
    cut = [store.pair(i) for i in range(4)]  # the sample's completions are equally long: cut chosen's short
    pairs = [
        PairIds(p.index, p.source_id, p.prompt, p.chosen[: max(1, len(p.chosen) - 2 - i)], p.rejected)
        for i, p in enumerate(cut)
    ]
    assert all(len(p.chosen) < len(p.rejected) for p in pairs)
    batch = pack_microbatch(pairs, pad_to_multiple_of=8)
    batch.update(
        microbatch=0, microbatches_in_step=1, step_pairs=4, step_chosen_tokens=sum(len(p.chosen) for p in pairs)
    )

    def trainer_for(**loss):
        config = {
            "model": {"init": {"config": TINY_LLAMA, "seed": 0}},
            "data": {"path": str(sample_dataset)},
            "loss": {"beta": 0.5, **loss},
            "train": {"output_dir": "unused"},
            "distributed": {"device": "cpu"},
        }
        return tiny_trainer(config, store=store)

    def gradient(trainer):
        return torch.cat([p.grad.flatten() for p in trainer.policy.parameters()])

    def trained(**loss):
        trainer = trainer_for(**loss)
        trainer.microbatch(dict(batch))
        return gradient(trainer)

    trainer = trainer_for(ld_alpha=0.3, use_weighting=True)
    policy = pair_logps(trainer.model, batch, Scoring(), ld_alpha=0.3, weighting=True)
    policy.weights = policy.weights.detach()
    terms = pair_losses(policy, trainer.reference.logps(batch), trainer.config.loss)
    microbatch_loss(terms.losses, 4).backward()
    expected = gradient(trainer)
    torch.testing.assert_close(trained(ld_alpha=0.3, use_weighting=True), expected, rtol=1e-5, atol=1e-9)
    plain = trained()
    torch.testing.assert_close(trained(ld_alpha=1.0), plain, rtol=0, atol=0)
    assert not torch.allclose(trained(ld_alpha=0.3), plain, rtol=1e-3, atol=0)
    assert not torch.allclose(trained(use_weighting=True), plain, rtol=1e-3, atol=0)
