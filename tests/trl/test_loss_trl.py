"""The loss family against TRL 1.16's own loss code on identical log-probabilities.

TRL computes its loss inside `DPOTrainer._compute_loss(model, inputs)`, from the per-token log-probs the
model returns. A stand-in model returns per-token log-probs spread evenly over each completion's tokens, so
that their row sums are our summed log-probs and TRL's mean over the chosen tokens (its `sft`) is our NLL per
chosen token; the reference log-probs go in as precomputed: TRL's real code then turns them into its loss.
Ours is what the trainer calls: `microbatch_loss` over `pair_losses`, with the config's `sft_weight`, for one
micro-batch that is the whole step.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from dpo_train.logps.pairs import PairLogps
from dpo_train.logps.scoring import Scoring
from dpo_train.reference.choice import ReferenceLogps
from dpo_train.step.loss import LOSSES, LossConfig, pair_losses
from dpo_train.step.metrics import add_pairs, new_sums, step_record
from dpo_train.step.objective import microbatch_loss
from dpo_train.step.sort import SortScores, sorted_types, step_partners
from tests.tiny import tiny_llama_model

CHOSEN = torch.tensor([-10.0, -4.0, -7.5, -3.0])
REJECTED = torch.tensor([-12.0, -3.0, -7.5, -9.0])
REF_CHOSEN = torch.tensor([-11.0, -4.5, -7.0, -3.5])
REF_REJECTED = torch.tensor([-11.0, -3.5, -8.0, -8.0])
CHOSEN_TOKENS = torch.tensor([5, 2, 3, 1])
REJECTED_TOKENS = torch.tensor([4, 1, 3, 6])
LENGTH = 9  # sequence length of TRL's padded batch


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory, smollm2_dir):
    import datasets
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    def tiny():
        return tiny_llama_model(num_hidden_layers=1)

    row = {"prompt": "Q:", "chosen": " a", "rejected": " b"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = DPOConfig(output_dir=str(tmp_path_factory.mktemp("trl-loss")), report_to=[], bf16=False, use_cpu=True)
        trainer = DPOTrainer(
            model=tiny(),
            ref_model=tiny(),
            args=args,
            processing_class=AutoTokenizer.from_pretrained(smollm2_dir),
            train_dataset=datasets.Dataset.from_list([row]),
        )
    return trainer


def trl_loss(
    trainer,
    config: LossConfig,
    dtype: torch.dtype,
    trl_label_smoothing: float | None = None,
    leaves: list | None = None,
) -> float:
    """TRL's loss for the config's keys, as TRL names them (its label_smoothing may be set apart). `leaves`: a
    list to which the per-token log-probs are appended, a leaf with its gradient after the loss's backward."""
    n = len(CHOSEN)
    completion = torch.zeros(2 * n, LENGTH, dtype=torch.long)
    per_token = torch.zeros(2 * n, LENGTH - 1, dtype=dtype)
    for i, (count, total) in enumerate(
        zip(torch.cat([CHOSEN_TOKENS, REJECTED_TOKENS]).tolist(), torch.cat([CHOSEN, REJECTED]).tolist())
    ):
        completion[i, LENGTH - count :] = 1  # completion tokens at the end, as TRL's collator lays them out
        per_token[i, -count:] = total / count  # the shifted positions that predict them: rows sum to ours

    if leaves is not None:
        leaves.append(per_token.requires_grad_())

    def model(**kwargs):
        return types.SimpleNamespace(
            log_probs=per_token,
            entropy=torch.zeros_like(per_token),
            mean_logits=torch.zeros_like(per_token),
            is_top1=torch.zeros_like(per_token, dtype=torch.bool),
        )

    trainer.loss_types, trainer.loss_weights = config.types, [weight for _, weight in config.members]
    trainer.beta = config.beta
    trainer.label_smoothing = config.label_smoothing if trl_label_smoothing is None else trl_label_smoothing
    trainer.f_divergence_type, trainer.f_alpha_divergence_coef = (
        config.f_divergence_type,
        config.f_alpha_divergence_coef,
    )
    trainer.args.discopop_tau = config.discopop_tau
    trainer.precompute_ref_logps = True
    inputs = {
        "input_ids": torch.zeros(2 * n, LENGTH, dtype=torch.long),
        "attention_mask": torch.ones(2 * n, LENGTH),
        "completion_mask": completion,
        "ref_chosen_logps": REF_CHOSEN.to(dtype),
        "ref_rejected_logps": REF_REJECTED.to(dtype),
    }
    loss = trainer._compute_loss(model, inputs, return_outputs=False)
    if leaves is not None:
        loss.backward()
    return float(loss.detach())


def our_loss(config: LossConfig, dtype: torch.dtype, leaves: list | None = None) -> float:
    """The step loss the trainer backpropagates for these pairs as one micro-batch (the whole step); with
    `leaves`, the policy's summed log-probs (chosen, rejected) are appended with their gradient."""
    chosen, rejected, ref_chosen, ref_rejected = (t.to(dtype) for t in (CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED))
    if leaves is not None:
        leaves += [chosen.requires_grad_(), rejected.requires_grad_()]
    scores = SortScores(torch.arange(len(CHOSEN)), chosen, rejected, ref_chosen, ref_rejected)
    partners = step_partners([scores], config)[0] if sorted_types(config) else None
    policy = PairLogps(chosen, rejected, CHOSEN_TOKENS, REJECTED_TOKENS)
    terms = pair_losses(policy, ReferenceLogps(ref_chosen, ref_rejected), config, partners=partners)
    loss = microbatch_loss(terms.losses, len(CHOSEN), -chosen.sum(), float(CHOSEN_TOKENS.sum()), config.sft_weight)
    if leaves is not None:
        loss.backward()
    return float(loss.detach())


def our_logged_loss(config: LossConfig, dtype: torch.dtype) -> float:
    """metrics.jsonl's `loss` for these pairs as one step: the trainer's step sums (`add_pairs`) turned into
    the step record (`step_record`) with the config's NLL weight, as `Trainer.step` logs it."""
    chosen, rejected, ref_chosen, ref_rejected = (t.to(dtype) for t in (CHOSEN, REJECTED, REF_CHOSEN, REF_REJECTED))
    scores = SortScores(torch.arange(len(CHOSEN)), chosen, rejected, ref_chosen, ref_rejected)
    partners = step_partners([scores], config)[0] if sorted_types(config) else None
    policy = PairLogps(chosen, rejected, CHOSEN_TOKENS.to(dtype), REJECTED_TOKENS.to(dtype))
    terms = pair_losses(policy, ReferenceLogps(ref_chosen, ref_rejected), config, partners=partners)
    n = len(CHOSEN)
    batch = {  # the row's segments: chosen then rejected of each pair, one source
        "segment_pair": torch.arange(n).repeat_interleave(2),
        "segment_length": torch.stack([CHOSEN_TOKENS, REJECTED_TOKENS], dim=1).flatten(),
        "pair_source": torch.zeros(n, dtype=torch.long),
    }
    sums = new_sums(1)
    add_pairs(sums, batch, terms, policy, capacity=100)
    return step_record(sums, ["rows"], 1.0, 1e-5, 0, 1.0, nll_weight=config.sft_weight)["loss"]


F64 = dict(rel=1e-6, abs=1e-12)
ALONE = [
    dict(type="sigmoid", beta=0.1),
    dict(type="sigmoid", beta=0.7),
    dict(type="ipo", beta=0.5),
    dict(type="hinge", beta=0.3),
    dict(type="robust", beta=0.3, label_smoothing=0.2),
    dict(type="exo_pair", beta=0.3, label_smoothing=1e-3),
    dict(type="nca_pair", beta=0.4),
    dict(type="bco_pair", beta=0.4),
    dict(type="sppo_hard", beta=0.5),
    dict(type="apo_zero", beta=0.7),
    dict(type="apo_down", beta=0.7),
    dict(type="discopop", beta=0.3),
    dict(type="discopop", beta=0.3, discopop_tau=0.5),
    dict(type="sft"),
    dict(type="sft", beta=0.3),
    dict(type="sigmoid_norm", beta=2.0),
    dict(type="aot", beta=0.3),
    dict(type="aot", beta=0.3, label_smoothing=0.2),
    dict(type="aot_unpaired", beta=0.5),
    dict(type="aot_unpaired", beta=0.5, label_smoothing=0.1),
]


@pytest.mark.parametrize("config", ALONE, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_each_type_alone_is_trls_loss(trl_trainer, config):
    """float64, 1e-6 relative: each type's per-pair mean (plus, for sft, the NLL per chosen token) is TRL's."""
    config = LossConfig(**config)
    assert our_loss(config, torch.float64) == pytest.approx(trl_loss(trl_trainer, config, torch.float64), **F64)


SORTED = [
    dict(type="aot", beta=0.3, label_smoothing=0.2),
    dict(type="aot_unpaired", beta=0.5, label_smoothing=0.1),
    dict(type=["aot", "aot_unpaired", "sigmoid", "sft"], weights=[0.5, 0.7, 1.0, 0.3], beta=0.4),
]


@pytest.mark.parametrize("config", SORTED, ids=lambda c: str(c["type"]))
def test_the_sorted_types_are_trls_loss_and_gradient(trl_trainer, config):
    """AOT sorts over the batch: its gradient reaches each pair through its sorted partner. Ours, per pair with
    the partners as constants (the rejected side's value taken out again), is TRL's torch.sort in value and in
    the gradient of every pair's log-probs (TRL's: on any one of a completion's evenly spread tokens)."""
    config = LossConfig(**config)
    ours, theirs = [], []
    assert our_loss(config, torch.float64, ours) == pytest.approx(
        trl_loss(trl_trainer, config, torch.float64, leaves=theirs), **F64
    )
    n, per_token = len(CHOSEN), theirs[0].grad
    torch.testing.assert_close(ours[0].grad, per_token[:n, -1], rtol=1e-6, atol=1e-12)
    torch.testing.assert_close(ours[1].grad, per_token[n:, -1], rtol=1e-6, atol=1e-12)
    assert ours[0].grad.abs().min() > 0 and ours[1].grad.abs().min() > 0  # every pair takes a gradient


@pytest.mark.parametrize(
    "config",
    [
        dict(type=["sigmoid", "bco_pair", "sft"], weights=[0.8, 0.2, 1.0], beta=0.3),  # the issue's, TRL's MPO
        dict(type=["sft", "ipo", "discopop"], weights=[0.5, 2.0, 0.25], beta=0.5),
        dict(type=["hinge", "apo_zero"], beta=0.2),  # weights null: 1.0 each, as TRL's loss_weights None
    ],
    ids=["mpo", "sft-first", "no-weights"],
)
def test_a_weighted_list_is_trls_loss(trl_trainer, config):
    config = LossConfig(**config)
    assert our_loss(config, torch.float64) == pytest.approx(trl_loss(trl_trainer, config, torch.float64), **F64)


LISTS = [
    dict(type=["sigmoid", "sft"], weights=[1.0, 0.5], beta=0.1),  # the issue's: TRL logged 6.1082, we 0.6931
    dict(type=["sigmoid", "bco_pair", "sft"], weights=[0.8, 0.2, 1.0], beta=0.3),
    dict(type=["sft", "ipo", "discopop"], weights=[0.5, 2.0, 0.25], beta=0.5),
    dict(type=["hinge", "apo_zero"], beta=0.2),
    dict(type=["aot", "aot_unpaired", "sigmoid", "sft"], weights=[0.5, 0.7, 1.0, 0.3], beta=0.4),
]


@pytest.mark.parametrize("config", ALONE + LISTS, ids=lambda c: "-".join(f"{v}" for v in c.values()))
def test_the_logged_loss_is_trls_loss(trl_trainer, config):
    """metrics.jsonl's `loss` is the objective TRL optimizes and logs as `loss` (one batch, one step: the
    value of its `_compute_loss`), sft's NLL term included, for every type TRL's DPOTrainer runs and for
    weighted lists; float64, 1e-6 relative."""
    config = LossConfig(**config)
    trl = trl_loss(trl_trainer, config, torch.float64)
    assert our_logged_loss(config, torch.float64) == pytest.approx(trl, **F64)


@pytest.mark.parametrize(
    "config, dtype",
    [
        (dict(type="sigmoid", f_divergence_type="forward_kl"), torch.float64),
        (dict(type="sigmoid", f_divergence_type="js_divergence"), torch.float64),
        (dict(type="sigmoid", f_divergence_type="alpha_divergence"), torch.float32),  # TRL's: float32 alone
        (dict(type="sigmoid", f_divergence_type="alpha_divergence", f_alpha_divergence_coef=0.2), torch.float32),
        (dict(type="sigmoid", f_divergence_type="alpha_divergence", f_alpha_divergence_coef=1.0), torch.float32),
        (dict(type="ipo", beta=0.5, f_divergence_type="forward_kl"), torch.float64),
        (dict(type="sigmoid_norm", beta=2.0, f_divergence_type="js_divergence"), torch.float64),
        (dict(type=["exo_pair", "sft"], label_smoothing=1e-3, f_divergence_type="forward_kl"), torch.float64),
    ],
    ids=["forward", "js", "alpha", "alpha-0.2", "alpha-1", "ipo-forward", "norm-js", "exo-sft-forward"],
)
def test_each_f_divergence_is_trls_loss(trl_trainer, config, dtype):
    """TRL's alpha_divergence clamps by a per-dtype table that has no float64, so it runs in float32 (1e-5)."""
    config = LossConfig(**{"beta": 0.7, **config})
    tolerance = F64 if dtype == torch.float64 else dict(rel=1e-5)
    assert our_loss(config, dtype) == pytest.approx(trl_loss(trl_trainer, config, dtype), **tolerance)


def test_trls_sigmoid_ignores_label_smoothing_and_ours_applies_it(trl_trainer):
    """A known difference (docs/objective.md): TRL 1.16's sigmoid is plain DPO whatever label_smoothing says;
    ours reads it as conservative DPO. With 0.3, TRL's loss is our e = 0 loss, and ours differs."""
    plain, smoothed = LossConfig(type="sigmoid", beta=0.7), LossConfig(type="sigmoid", beta=0.7, label_smoothing=0.3)
    trl = trl_loss(trl_trainer, plain, torch.float64, trl_label_smoothing=0.3)
    assert our_loss(plain, torch.float64) == pytest.approx(trl, **F64)
    assert our_loss(smoothed, torch.float64) != pytest.approx(trl, rel=1e-2)


# -- the reference-free methods against TRL 1.16's experimental CPO and ORPO trainers --


def _trl_stand_in(config: LossConfig, **trl_keys) -> types.SimpleNamespace:
    """A `self` for the trainers' loss methods: the attributes their __init__ sets from the config."""
    return types.SimpleNamespace(
        beta=config.beta,
        label_smoothing=config.label_smoothing,
        simpo_gamma=config.target_margin,
        accelerator=types.SimpleNamespace(device="cpu"),
        **trl_keys,
    )


def _trl_logps(per_token_mean: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy log-probs TRL's `concatenated_forward` hands the loss: `get_batch_logps` sums, or averages
    with `average_log_prob` (CPOTrainer: for ipo and simpo; ORPOTrainer: always)."""
    chosen, rejected = CHOSEN.double(), REJECTED.double()
    if per_token_mean:
        return chosen / CHOSEN_TOKENS, rejected / REJECTED_TOKENS
    return chosen, rejected


CPO_CASES = [
    # (ours, TRL's CPOConfig keys, TRL averages the log-probs)
    (dict(type=["cpo", "sft"], weights=[1.0, 1.0], beta=0.1), dict(loss_type="sigmoid", cpo_alpha=1.0), False),
    (dict(type="cpo", beta=0.7, nll_weight=0.3, label_smoothing=0.2), dict(loss_type="sigmoid", cpo_alpha=0.3), False),
    (dict(type=["cpo", "sft"], weights=[1.0, 0.0], beta=0.4), dict(loss_type="sigmoid", cpo_alpha=0.0), False),
    (dict(type="simpo", beta=2.0, target_margin=0.5), dict(loss_type="simpo", cpo_alpha=0.0), True),
    (
        dict(type="simpo", beta=2.5, target_margin=1.2, label_smoothing=0.1),
        dict(loss_type="simpo", cpo_alpha=0.0),
        True,
    ),
    (dict(type=["simpo", "sft"], beta=2.0), dict(loss_type="simpo", cpo_alpha=1.0), True),  # TRL's default cpo_alpha
    (dict(type="alphapo", beta=2.0, alpha=0.25, target_margin=0.5), dict(loss_type="alphapo", alpha=0.25), True),
    (
        dict(type="alphapo", beta=1.5, alpha=-0.5, target_margin=0.3, label_smoothing=0.1),
        dict(loss_type="alphapo", alpha=-0.5),
        True,
    ),
    (dict(type="alphapo", beta=2.0, alpha=0.0), dict(loss_type="alphapo", alpha=0.0), True),
    (dict(type=["cpo", "sft"], beta=0.1, alpha=0.01), dict(loss_type="sigmoid", alpha=0.01, cpo_alpha=1.0), False),
    (dict(type=["cpo_hinge", "sft"], beta=0.3), dict(loss_type="hinge", cpo_alpha=1.0), False),
    (
        dict(type="cpo_hinge", beta=0.3, alpha=0.05, nll_weight=0.5),
        dict(loss_type="hinge", alpha=0.05, cpo_alpha=0.5),
        False,
    ),
    (dict(type="cpo_ipo", beta=0.5, nll_weight=1.0), dict(loss_type="ipo", cpo_alpha=1.0), True),
    (dict(type="cpo_ipo", beta=0.5, alpha=0.3, nll_weight=0.2), dict(loss_type="ipo", alpha=0.3, cpo_alpha=0.2), True),
]


def _trl_cpo_loss(config: LossConfig, trl_keys: dict, averaged: bool) -> tuple[float, torch.Tensor, torch.Tensor]:
    """CPOTrainer's own `cpo_loss` on the log-probs it would feed it, combined as `get_batch_loss_metrics`
    combines it: losses.mean() + cpo_alpha * nll, nll the chosen completion tokens' mean NLL (as ours here);
    and its rewards."""
    from trl.experimental.cpo import CPOConfig, CPOTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = CPOConfig(output_dir="unused", report_to=[], use_cpu=True, **trl_keys)  # its __post_init__: alphapo
    assert (args.loss_type in ["ipo", "simpo"]) == averaged  # concatenated_forward's average_log_prob
    stand_in = _trl_stand_in(config, loss_type=args.loss_type, alpha=args.alpha)
    losses, chosen_rewards, rejected_rewards = CPOTrainer.cpo_loss(stand_in, *_trl_logps(averaged))
    nll = -CHOSEN.double().sum() / CHOSEN_TOKENS.sum()
    return float(losses.mean() + args.cpo_alpha * nll), chosen_rewards, rejected_rewards


@pytest.mark.parametrize("ours, trl_keys, averaged", CPO_CASES, ids=lambda v: str(v) if isinstance(v, bool) else None)
def test_the_cpo_trainer_types_are_trls(ours, trl_keys, averaged):
    """float64, 1e-6 relative: our step loss is CPOTrainer's (its `cpo_loss` plus cpo_alpha times the NLL),
    and so are the rewards."""
    config = LossConfig(**ours)
    assert config.needs_reference is False
    trl, chosen_rewards, rejected_rewards = _trl_cpo_loss(config, trl_keys, averaged)
    assert our_loss(config, torch.float64) == pytest.approx(trl, **F64)
    terms = pair_losses(PairLogps(CHOSEN.double(), REJECTED.double(), CHOSEN_TOKENS, REJECTED_TOKENS), None, config)
    torch.testing.assert_close(terms.chosen_rewards, chosen_rewards, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(terms.rejected_rewards, rejected_rewards, rtol=1e-9, atol=1e-12)


@pytest.mark.parametrize("ours, trl_keys, averaged", CPO_CASES, ids=lambda v: str(v) if isinstance(v, bool) else None)
def test_the_logged_loss_is_the_cpo_trainers_loss(ours, trl_keys, averaged):
    """CPOTrainer logs its objective (cpo_loss plus cpo_alpha times the NLL) as `loss`: ours logs the same."""
    config = LossConfig(**ours)
    assert our_logged_loss(config, torch.float64) == pytest.approx(_trl_cpo_loss(config, trl_keys, averaged)[0], **F64)


def test_the_logged_loss_is_the_orpo_trainers_loss():
    """ORPOTrainer logs nll - mean(beta log s(log odds ratio)) as `loss`: ours logs the same (1e-6, its float32)."""
    from trl.experimental.orpo import ORPOTrainer

    config = LossConfig(type=["orpo", "sft"], beta=0.5)
    losses, *_ = ORPOTrainer.odds_ratio_loss(_trl_stand_in(config), *_trl_logps(True))
    nll = -CHOSEN.double().sum() / CHOSEN_TOKENS.sum()
    assert our_logged_loss(config, torch.float64) == pytest.approx(float(nll - losses.mean()), rel=1e-6)


def test_every_loss_type_has_its_logged_loss_checked_against_trl():
    """The logged-loss checks above cover every name of LOSSES: DPOTrainer's types, CPO's and ORPO's."""
    checked = {"orpo", "sft"}
    for config in ALONE + LISTS + [ours for ours, _, _ in CPO_CASES]:
        checked.update(LossConfig(**config).types)
    assert checked == set(LOSSES)


@pytest.mark.parametrize("beta", [0.1, 0.5, 2.0])
def test_orpo_is_trls_orpo_trainer(beta):
    """ORPOTrainer's own `odds_ratio_loss` on per-token mean log-probs, combined as its
    `get_batch_loss_metrics`: nll - losses.mean() (its losses are beta log s(l), ours the negation). TRL's NLL
    covers the chosen prompt tokens too (docs/objective.md); here both are the chosen completion tokens' mean.
    TRL computes the odds ratio in float32: 1e-6 relative."""
    from trl.experimental.orpo import ORPOTrainer

    config = LossConfig(type=["orpo", "sft"], beta=beta)
    losses, chosen_rewards, *_ = ORPOTrainer.odds_ratio_loss(_trl_stand_in(config), *_trl_logps(True))
    nll = -CHOSEN.double().sum() / CHOSEN_TOKENS.sum()
    assert our_loss(config, torch.float64) == pytest.approx(float(nll - losses.mean()), rel=1e-6)
    ours = pair_losses(PairLogps(CHOSEN.double(), REJECTED.double(), CHOSEN_TOKENS, REJECTED_TOKENS), None, config)
    torch.testing.assert_close(ours.chosen_rewards.float(), chosen_rewards.float())


# -- LD-DPO (ld_alpha) and WPO (use_weighting): per-token values through pair_logps against TRL's _compute_loss --


def _per_token_pairs() -> list:
    """Pairs whose completions differ in length, so that LD-DPO's shared length cuts one of them."""
    import numpy as np

    from dpo_data.dataset.store import PairIds

    rng = np.random.default_rng(3)
    shapes = [(2, 5, 3), (1, 1, 4), (3, 3, 3), (2, 6, 1)]  # (prompt, chosen, rejected) tokens
    ids = lambda k: rng.integers(0, 11, size=k).astype(np.int32)
    return [PairIds(i, 0, ids(p), ids(c), ids(r)) for i, (p, c, r) in enumerate(shapes)]


class _Logits:
    """A stand-in model for pair_logps: fixed float64 logits per row position, whatever the inputs."""

    config = types.SimpleNamespace(_attn_implementation=None)  # no attention mask to build

    def __init__(self, table: torch.Tensor):
        self.table = table

    def __call__(self, **inputs):
        return types.SimpleNamespace(logits=self.table[None])


def _trl_per_token(table: torch.Tensor, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """TRL's batch for the same values, read straight off the packed row: per completion segment, in position
    order, log p(label) and log sum_v p(v)^2 at the positions that predict its tokens (labels are pre-shifted),
    laid out as TRL's padded [chosen..., rejected...] rows (completion tokens at the end)."""
    from dpo_data.loading.microbatch import IGNORE_INDEX

    n, log_probs = batch["num_pairs"], torch.log_softmax(table, dim=-1)
    completion = torch.zeros(2 * n, LENGTH, dtype=torch.long)
    per_token, log_sum_sq = torch.zeros(2 * n, LENGTH - 1, dtype=table.dtype), torch.zeros(2 * n, LENGTH - 1)
    log_sum_sq = log_sum_sq.to(table.dtype)
    cu, labels = batch["cu_seqlens"].tolist(), batch["labels"][0]
    for s, (role, pair) in enumerate(zip(batch["segment_role"].tolist(), batch["segment_pair"].tolist())):
        if role not in (0, 1):
            continue
        positions = [t for t in range(cu[s], cu[s + 1]) if labels[t] != IGNORE_INDEX]
        row, count = role * n + pair, len(positions)
        completion[row, LENGTH - count :] = 1
        per_token[row, -count:] = log_probs[positions, labels[positions]]
        log_sum_sq[row, -count:] = torch.logsumexp(2 * log_probs[positions], dim=-1)
    return completion, per_token, log_sum_sq


def _trl_outputs(per_token: torch.Tensor, log_sum_sq: torch.Tensor | None = None):
    def model(**kwargs):
        return types.SimpleNamespace(
            log_probs=per_token,
            log_sum_sq_probs=log_sum_sq,
            entropy=torch.zeros_like(per_token),
            mean_logits=torch.zeros_like(per_token),
            is_top1=torch.zeros_like(per_token, dtype=torch.bool),
        )

    return model


PER_TOKEN_TYPES = [
    dict(type="sigmoid", beta=0.7),
    dict(type="ipo", beta=0.5),  # per-token means: TRL divides LD sums by the full lengths, as ours
    dict(type=["hinge", "bco_pair"], weights=[0.6, 1.5], beta=0.3),  # each listed type's loss is weighted
]


@pytest.mark.parametrize("use_weighting", [False, True], ids=["plain", "wpo"])
@pytest.mark.parametrize("ld_alpha", [None, 0.0, 0.4, 1.0], ids=lambda a: f"ld-{a}")
@pytest.mark.parametrize("config", PER_TOKEN_TYPES, ids=lambda c: str(c["type"]))
def test_ld_alpha_and_use_weighting_are_trls_loss(trl_trainer, monkeypatch, config, ld_alpha, use_weighting):
    """float64, 1e-6 relative: the policy's and the live reference's LD-DPO sums and the WPO weights, computed by
    pair_logps on one packed row, give TRL's `_compute_loss` on the same per-token values (its reference
    forward included, which applies ld_alpha too)."""
    from accelerate import Accelerator

    from dpo_data.loading.microbatch import pack_microbatch
    from dpo_train.logps.pairs import pair_logps
    from dpo_train.reference.choice import Reference

    Accelerator(cpu=True)  # the CPO tests' CPOConfig resets accelerate's shared state, which _compute_loss reads

    config = LossConfig(**config, ld_alpha=ld_alpha, use_weighting=use_weighting)
    batch = pack_microbatch(_per_token_pairs(), pad_to_multiple_of=8)
    generator = torch.Generator().manual_seed(5)
    shape = (batch["input_ids"].shape[1], 11)
    policy_table, reference_table = (torch.randn(*shape, generator=generator, dtype=torch.float64) for _ in "pr")

    policy = pair_logps(_Logits(policy_table), batch, Scoring(), ld_alpha=ld_alpha, weighting=use_weighting)
    reference = Reference("live", None, None, _Logits(reference_table), ld_alpha=ld_alpha).logps(batch)
    terms = pair_losses(policy, reference, config)
    chosen_tokens = float(policy.chosen_tokens.sum())
    ours = microbatch_loss(terms.losses, 4, -policy.chosen.sum(), chosen_tokens, config.sft_weight)

    completion, per_token, log_sum_sq = _trl_per_token(policy_table, batch)
    _, ref_per_token, _ = _trl_per_token(reference_table, batch)
    for key, value in dict(
        loss_types=config.types,
        loss_weights=[weight for _, weight in config.members],
        beta=config.beta,
        label_smoothing=0.0,
        f_divergence_type="reverse_kl",
        precompute_ref_logps=False,
        ref_model=_trl_outputs(ref_per_token),
        ld_alpha=ld_alpha,
        use_weighting=use_weighting,
    ).items():
        monkeypatch.setattr(trl_trainer, key, value)
    inputs = {
        "input_ids": torch.zeros(8, LENGTH, dtype=torch.long),
        "attention_mask": torch.ones(8, LENGTH),
        "completion_mask": completion,
    }
    trl = trl_trainer._compute_loss(_trl_outputs(per_token, log_sum_sq), inputs, return_outputs=False)
    assert float(ours) == pytest.approx(float(trl), **F64)
    assert (policy.ld is None) == (ld_alpha is None) and (policy.weights is None) == (not use_weighting)
