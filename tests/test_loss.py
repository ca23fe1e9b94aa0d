"""Loss family: each closed form on hand-sized tensors against an independent scalar reference."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest
import torch

from dpo_train.errors import ConfigError
from dpo_train.loss import LOSSES, LossConfig, LossType, pair_losses

# Three pairs: summed completion log-probs under the policy and the reference, and token counts.
C, R = torch.tensor([-10.0, -4.0, -7.5]), torch.tensor([-12.0, -3.0, -7.5])
C0, R0 = torch.tensor([-11.0, -4.5, -7.0]), torch.tensor([-11.0, -3.5, -8.0])
NC, NR = torch.tensor([5, 2, 3]), torch.tensor([4, 1, 3])
TOL = dict(rtol=1e-6, atol=1e-6)


def log_sigmoid(x: float) -> float:
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def margins(avg=False):
    out = []
    for c, r, c0, r0, nc, nr in zip(C.tolist(), R.tolist(), C0.tolist(), R0.tolist(), NC.tolist(), NR.tolist()):
        out.append((c - c0) / nc - (r - r0) / nr if avg else (c - c0) - (r - r0))
    return out


def losses(**config):
    return pair_losses(LossConfig(**config), C, R, C0, R0, NC, NR)


@pytest.mark.parametrize("eps", [0.0, 0.1, 0.5])
def test_sigmoid_and_conservative_dpo(eps):
    """L = -(1 - e) log s(b D) - e log s(-b D)."""
    b = 0.3
    expected = [-(1 - eps) * log_sigmoid(b * d) - eps * log_sigmoid(-b * d) for d in margins()]
    torch.testing.assert_close(
        losses(type="sigmoid", beta=b, label_smoothing=eps).losses, torch.tensor(expected), **TOL
    )


def test_sigmoid_is_log2_when_policy_equals_reference():
    out = pair_losses(LossConfig(), C, R, C, R, NC, NR)
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
    out = pair_losses(LossConfig(type="simpo", beta=b, target_margin=g), C, R, None, None, NC, NR)
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


def test_a_loss_type_is_one_registry_entry(monkeypatch):
    """The per-pair computation and `needs_reference` read `LOSSES` alone: an entry added there is computed,
    its form given the token counts because it asks for per-token means, and no reference because it
    needs none (the config's checks read the same entry: tests/test_config.py)."""
    given = []

    def form(config, chosen, rejected, counts):
        given.append(counts)
        return chosen / counts[0] - rejected / counts[1], chosen, rejected

    monkeypatch.setitem(LOSSES, "mean_gap", LossType(form, needs_reference=False, per_token_means=True))
    config = LossConfig(type="mean_gap")
    assert config.needs_reference is False and LossConfig(type="sigmoid").needs_reference is True
    out = pair_losses(config, C, R, None, None, NC, NR)
    torch.testing.assert_close(out.losses, C / NC - R / NR, rtol=0, atol=0)
    assert [c.tolist() for c in given[0]] == [NC.float().tolist(), NR.float().tolist()]


def test_an_unknown_loss_type_is_named_with_the_registrys_names():
    with pytest.raises(ConfigError) as info:
        pair_losses(LossConfig(type="kto"), C, R, C0, R0, NC, NR)
    assert str(info.value).startswith(f"loss.type is 'kto'; allowed: {', '.join(LOSSES)}; set loss.type to one")


def test_reference_losses_refuse_a_missing_reference():
    with pytest.raises(ConfigError, match="needs reference log-probs"):
        pair_losses(LossConfig(), C, R, None, None, NC, NR)


def test_the_docs_loss_table_is_the_registry():
    """docs/objective.md's table states each type's facts; they must be its `LOSSES` entry's, row for row."""
    text = (Path(__file__).resolve().parents[1] / "docs" / "objective.md").read_text()
    table = text.split("| `loss.type` | per-pair loss | reference |")[1].split("\n\n")[0].splitlines()[2:]
    rows = [[cell.strip() for cell in re.split(r"(?<!\\)\|", line)[1:-1]] for line in table]
    documented = {name.strip("`"): (reference, smoothing, means) for name, _, reference, smoothing, means, _ in rows}
    assert documented == {
        name: (
            "needed" if kind.needs_reference else "none",
            str(kind.label_smoothing) if kind.label_smoothing else "none",
            "always" if kind.per_token_means else "with `average_log_prob`",
        )
        for name, kind in LOSSES.items()
    }
