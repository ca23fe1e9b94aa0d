"""Every loss type of `LOSSES` trains end to end through `dpo-train`, and TRL's MPO-style list adds up.

Each type's run is configured from its registry entry alone (`_loss_section`), so a type added later is run
here without a line changed; one that needs a setting the entry does not say fails its run (exit 2, its
error shown), and one whose step-0 value is not written down below fails by name, never skipped.
All runs share one dataset (24 pairs, 4 a step), one random init (TINY_LLAMA, seed 0) and the real tokenizer,
so step 0 of every run sees the same pairs under the same weights, with the policy equal to its reference.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from dpo_train.step.loss import LOSSES, Interval, LossConfig
from tests.harness import TINY_LLAMA, tiny_config, train_here, write_yaml

BETA = LossConfig().beta
NLL_WEIGHT = 1.0
"""The NLL term's weight for the types whose method adds it (`with_nll`: CPO's BC term, ORPO's SFT term)."""
MPO = {"type": ["sigmoid", "bco_pair", "sft"], "weights": [0.8, 0.2, 1.0]}
"""TRL's MPO-style recipe: DPO and BCO per pair, plus the NLL of the chosen completions."""
STEPS = 2
LOG2 = math.log(2)
REL = 1e-6  # step-0 losses: fp32 per-pair values summed in float64 (sigmoid's log 2 is 2.7e-9 off in fp32)
LOGP_REL = 1e-5  # the packed segment path against unpacked sdpa forwards (docs/objective.md: 1e-5 per log-prob)

# The per-pair loss at policy = reference (x_c = x_r = 0, so D = D_avg = 0 under the default reverse_kl), from
# each type's closed form in docs/objective.md; (b, e) = (beta, label_smoothing). sft adds 0 per pair.
AT_REFERENCE = {
    "sigmoid": lambda b, e: LOG2,
    "ipo": lambda b, e: (1 / (2 * b)) ** 2,
    "hinge": lambda b, e: 1.0,
    "robust": lambda b, e: ((1 - e) * LOG2 - e * LOG2) / (1 - 2 * e),
    "exo_pair": lambda b, e: 0.5 * (-LOG2 - math.log(1 - e)) + 0.5 * (-LOG2 - math.log(e)),
    "nca_pair": lambda b, e: LOG2 + 0.5 * LOG2 + 0.5 * LOG2,
    "bco_pair": lambda b, e: 2 * LOG2,
    "sppo_hard": lambda b, e: 2 * (1 / (2 * b)) ** 2,
    "apo_zero": lambda b, e: (1 - 0.5) + 0.5,
    "apo_down": lambda b, e: 0.5 + (1 - 0.5),
    "discopop": lambda b, e: 0.5 * LOG2 + 0.5 * 1.0,
    "sft": lambda b, e: 0.0,
    "sigmoid_norm": lambda b, e: LOG2,
    # the sorted types: at policy = reference every pair's margin is its reference margin, so aot's sorts pair
    # each with itself (shift 0); aot_unpaired's log-ratios are all 0, and so are its partners
    "aot": lambda b, e: LOG2,
    "aot_unpaired": lambda b, e: LOG2,
}


def _softplus(x: float) -> float:
    """-log s(-x) = log(1 + e^x), without overflow."""
    return max(x, 0.0) + math.log1p(math.exp(-abs(x)))


def _log1mexp(x: float) -> float:
    return math.log(-math.expm1(x))


# The reference-free types read the policy's log-probs alone: their step-0 value is their closed form on the
# initial model's per-pair (c, r, |c|, |r|), computed by the `initial` fixture with unpacked forwards, at the
# loss defaults (target_margin 0.5, alpha 0: AlphaPO's u(x) = x, label_smoothing 0).
ON_POLICY = {
    "simpo": lambda c, r, nc, nr: _softplus(-(BETA * (c / nc - r / nr) - 0.5)),
    "cpo": lambda c, r, nc, nr: _softplus(-BETA * (c - r)),
    "alphapo": lambda c, r, nc, nr: _softplus(-(BETA * (c / nc - r / nr) - 0.5)),
    "orpo": lambda c, r, nc, nr: BETA * _softplus(-((c / nc - r / nr) - (_log1mexp(c / nc) - _log1mexp(r / nr)))),
    "cpo_hinge": lambda c, r, nc, nr: max(0.0, 1 - BETA * (c - r)),
    "cpo_ipo": lambda c, r, nc, nr: (c / nc - r / nr - 1 / (2 * BETA)) ** 2,
}


def _inside(interval: Interval) -> float:
    """A label_smoothing the type allows: 0 where it may be 0, else 1e-3 above the interval's low end (exo_pair:
    1e-3, the EXO paper's epsilon)."""
    return 0.0 if 0.0 in interval else interval.low + 1e-3


def _loss_section(name: str) -> dict:
    """The `loss:` settings a run of type `name` needs, read off its `LOSSES` entry alone."""
    kind, loss = LOSSES[name], {"type": name}
    if kind.with_nll:
        loss["nll_weight"] = NLL_WEIGHT
    if kind.label_smoothing is not None and 0.0 not in kind.label_smoothing:
        loss["label_smoothing"] = _inside(kind.label_smoothing)
    return loss


def _reference_mode(types: list[str]) -> str:
    return "live" if any(LOSSES[name].needs_reference for name in types) else "none"


class Runs:
    """The module's runs, each trained once on first use (`--dist loadfile` keeps a file on one worker)."""

    def __init__(self, dataset: Path, tokenizer: Path, tmp: Path):
        self.dataset, self.tokenizer, self.tmp, self.done = dataset, tokenizer, tmp, {}

    def get(self, run_cli, key: str, loss: dict, steps: int = STEPS, **optim) -> Path:
        """The run directory of `key`: `loss` on the shared init and data for `steps` steps (checkpointed at the
        last), `optim` added to the optimizer section."""
        if key not in self.done:
            out = self.tmp / key
            config = tiny_config(self.dataset, self.tokenizer, out, max_steps=steps, save_every=steps)
            config["loss"] = loss
            config["reference"] = {"mode": _reference_mode(LossConfig(**loss).types)}
            config["optim"].update(optim)
            train_here(run_cli, write_yaml(self.tmp / f"{key}.yaml", config))
            self.done[key] = out
        return self.done[key]


@pytest.fixture(scope="module")
def runs(small_dataset, smollm2_dir, tmp_path_factory) -> Runs:
    return Runs(small_dataset, smollm2_dir, tmp_path_factory.mktemp("loss-runs"))


def _metrics(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def initial(small_dataset, smollm2_dir) -> dict:
    """The initial policy's weights, and per-pair (c, r, |c|, |r|) of step 0's pairs from one unpacked,
    unpadded sdpa forward per segment (float64 sums of fp32 log-probs): what the runs' packed rows must give."""
    from dpo_data.dataset.store import PairStore
    from dpo_data.loading.loader import DPOLoader
    from dpo_train.config.loading import load_config
    from dpo_train.config.sections import ModelConfig
    from dpo_train.model.policy import load_policy

    config = load_config(tiny_config(small_dataset, smollm2_dir, Path("unused")))
    first = next(iter(DPOLoader(config.data.paths, config.data.loader_config(0, 1))))
    assert first["step"] == 0 and first["microbatches_in_step"] == 1  # step 0 is this one micro-batch
    store = PairStore(config.data.paths)
    model = load_policy(ModelConfig(init={"config": TINY_LLAMA, "seed": 0}), attention="sdpa").eval()
    logps = []
    with torch.no_grad():
        for index in first["pair_index"].tolist():
            pair = store.pair(index)
            sums = []
            for completion in (pair.chosen, pair.rejected):
                ids = torch.tensor([*pair.prompt, *completion]).unsqueeze(0)
                logits = model(input_ids=ids, use_cache=False).logits[0, len(pair.prompt) - 1 : -1]
                token_logps = torch.log_softmax(logits, -1).gather(1, torch.tensor(completion).long()[:, None])
                sums.append(float(token_logps.double().sum()))
            logps.append((*sums, len(pair.chosen), len(pair.rejected)))
    return {"weights": {k: v.clone() for k, v in model.state_dict().items()}, "logps": logps}


def _step_zero(types_and_weights: list[tuple[str, float]], smoothing: float, logps: list) -> float:
    """The expected step-0 `loss` (the mean per-pair part): each type's value at policy = reference, or its
    closed form on the initial policy's log-probs; a type written down in neither table fails by name."""
    total = 0.0
    for name, weight in types_and_weights:
        if name in AT_REFERENCE:
            value = AT_REFERENCE[name](BETA, smoothing)
        elif name in ON_POLICY:
            value = sum(ON_POLICY[name](*pair) for pair in logps) / len(logps)
        else:
            pytest.fail(
                f"loss type {name!r} has no step-0 value here: add its per-pair loss at policy = reference to "
                "AT_REFERENCE (or, reference-free, its closed form on policy log-probs to ON_POLICY)"
            )
        total += weight * value
    return total


CASES = {**{name: _loss_section(name) for name in LOSSES}, "mpo": MPO}
"""Every registry type alone (iterated, so a later type is in), and the MPO-style list."""


@pytest.mark.parametrize("key", list(CASES))
def test_every_loss_type_trains_two_steps_through_dpo_train(key, runs, initial, run_cli):
    """Exit 0 (train_here); `STEPS` steps of 4 pairs with finite values; step 0's loss is the type's closed form
    at policy = reference (rewards exactly 0 there) or on the initial policy's log-probs (reference-free), and
    its nll the initial policy's NLL per chosen token; every weight tensor moved; the resolved config and the
    checkpoint's run identity name the type and the reference mode."""
    loss = CASES[key]
    config = LossConfig(**loss)
    out = runs.get(run_cli, key, loss)
    rows = _metrics(out)
    assert [r["step"] for r in rows] == list(range(STEPS)) and all(r["pairs"] == 4 for r in rows), rows
    for r in rows:
        assert all(math.isfinite(r[k]) for k in ("loss", "nll", "grad_norm", "rewards/margins")), (key, r)

    logps = initial["logps"]
    expected = _step_zero(config.members, config.label_smoothing, logps)
    rel = REL if all(name in AT_REFERENCE for name in config.types) else LOGP_REL  # on-policy: the logps' own
    assert rows[0]["pair_loss"] == pytest.approx(expected, rel=rel, abs=1e-9), (key, rows[0]["pair_loss"], expected)
    nll = -sum(c for c, *_ in logps) / sum(nc for *_, nc, _ in logps)
    assert rows[0]["nll"] == pytest.approx(nll, rel=LOGP_REL), (key, rows[0]["nll"], nll)
    # the logged loss is the objective: the pair part plus the NLL term's weight times the NLL
    objective = rows[0]["pair_loss"] + config.sft_weight * rows[0]["nll"]
    assert rows[0]["loss"] == pytest.approx(objective, rel=1e-12), (key, rows[0])
    if config.needs_reference:  # every log-ratio is 0: the frozen copy scores what the policy scores
        assert rows[0]["rewards/chosen"] == pytest.approx(0.0, abs=1e-6), (key, rows[0])
        assert rows[0]["rewards/rejected"] == pytest.approx(0.0, abs=1e-6), (key, rows[0])

    final = load_file(out / "final" / "model.safetensors")
    assert final.keys() == initial["weights"].keys()
    still = [k for k, v in final.items() if torch.equal(v, initial["weights"][k])]
    assert not still, f"{key}: tensors the run left unchanged: {still}"

    resolved = yaml.safe_load((out / "config.resolved.yaml").read_text())
    mode = _reference_mode(config.types)
    assert resolved["loss"]["type"] == loss["type"] and resolved["reference"]["mode"] == mode
    (state,) = sorted(out.glob("checkpoints/*/state.json"))
    identity = json.loads(state.read_text())["identity"]
    assert identity["objective"]["type"] == loss["type"] and identity["reference"]["mode"] == mode, identity


def test_the_mpo_list_at_step_0_is_the_weighted_sum_of_its_types_runs(runs, run_cli):
    """[sigmoid, bco_pair, sft] with [0.8, 0.2, 1.0]: its logged `pair_loss` (docs/objective.md) is 0.8
    L_sigmoid + 0.2 L_bco_pair of those types' own runs at step 0, its `nll` the sft run's (whose pair part is
    0), and its logged `loss`, the step objective, 0.8 L_sigmoid + 0.2 L_bco_pair + 1.0 NLL."""
    step0 = {key: _metrics(runs.get(run_cli, key, CASES[key]))[0] for key in ("mpo", "sigmoid", "bco_pair", "sft")}
    assert step0["sft"]["pair_loss"] == 0.0 and step0["sft"]["loss"] == step0["sft"]["nll"]
    pair_part = 0.8 * step0["sigmoid"]["pair_loss"] + 0.2 * step0["bco_pair"]["pair_loss"]
    assert step0["mpo"]["pair_loss"] == pytest.approx(pair_part, rel=REL)
    assert step0["mpo"]["nll"] == step0["sft"]["nll"] == step0["sigmoid"]["nll"]
    assert step0["mpo"]["loss"] == pytest.approx(pair_part + step0["sft"]["nll"], rel=REL)


def test_the_mpo_list_steps_along_the_weighted_sum_of_its_types_gradients(runs, run_cli, initial):
    """With plain SGD, no clipping, one step, the weights move by -lr times the step gradient, which is linear
    in the objective: the list's move is 0.8, 0.2 and 1.0 times the sigmoid, bco_pair and sft runs' moves
    (sft: the NLL term alone), so the NLL term enters the list's gradient with its weight 1.0, once. (At
    policy = reference sigmoid's and bco_pair's gradients are the same, -b/2 grad(c - r), so this step pins
    the NLL term's weight and the pair types' total; the test above pins their split.)"""
    # lr 100: each move far above the fp32 rounding of the RMSNorm weights near 1.0 (lr 1: 8e-5 from it)
    sgd = {"name": "sgd", "lr": 100.0, "max_grad_norm": 0.0}
    moves = {}
    for key in ("mpo", "sigmoid", "bco_pair", "sft"):
        final = load_file(runs.get(run_cli, f"{key}-sgd", CASES[key], steps=1, **sgd) / "final" / "model.safetensors")
        moves[key] = {k: v.double() - initial["weights"][k].double() for k, v in final.items()}
    worst = 0.0
    for k, move in moves["mpo"].items():
        combined = 0.8 * moves["sigmoid"][k] + 0.2 * moves["bco_pair"][k] + 1.0 * moves["sft"][k]
        worst = max(worst, float((move - combined).norm() / move.norm()))
    assert worst <= 1e-5, worst  # measured 1.1e-6; the NLL term at the list's first weight (0.8): 0.22


@pytest.mark.parametrize(
    "loss",
    [MPO, {"type": ["aot", "aot_unpaired"], "beta": 2.0}],
    ids=["bco_pair-list", "aot"],
)
def test_a_run_cut_and_resumed_trains_bitwise_what_an_uncut_run_trains(loss, runs, run_cli, monkeypatch):
    """bco_pair keeps no state across steps (TRL 1.16's has no running reward mean: docs/objective.md), and the
    AOT types' pass without gradient draws on a fork of the RNG: so a run cut after its step-2 checkpoint and
    resumed ends in the uncut run's weights and losses, bit for bit, at step 4."""
    whole = runs.get(run_cli, f"whole-{loss['type'][-1]}", loss, steps=4)
    cut = runs.tmp / f"cut-{loss['type'][-1]}"
    config = tiny_config(runs.dataset, runs.tokenizer, cut, max_steps=4, save_every=2)
    config.update(loss=loss, reference={"mode": "live"})
    path = write_yaml(runs.tmp / f"cut-{loss['type'][-1]}.yaml", config)
    monkeypatch.setenv("DPO_TRAIN_FAULT", "0:3")  # rank 0 fails reading step 3, after the step-2 checkpoint
    train_here(run_cli, path, code=None)
    monkeypatch.delenv("DPO_TRAIN_FAULT")
    assert [r["step"] for r in _metrics(cut)] == [0, 1, 2]
    train_here(run_cli, path)
    assert [r["loss"] for r in _metrics(cut)] == [r["loss"] for r in _metrics(whole)]
    ours, theirs = load_file(cut / "final" / "model.safetensors"), load_file(whole / "final" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)
