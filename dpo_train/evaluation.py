"""Held-out evaluation: the run's objective on held-out pairs, and how many the policy prefers over the reference."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dpo_train.logps import Scoring
from dpo_train.reference import Scores, score_pairs
from dpo_train.run import Run
from dpo_train.step import LossConfig, SortScores, pair_losses, set_partners, sorted_types

EVAL_FORMAT_VERSION = 4
"""Every eval.jsonl record carries it; schema `eval-record`. 2: `loss` and `nll` added; 3: `pair_loss`, the
pair part of `loss`, as metrics.jsonl names it; 4: `margin`, the raw log-ratio margin, is `logratio_margin`, and
`rewards/margins` is TRL's: the loss's beta-scaled reward margin, as metrics.jsonl's (about ten times smaller at
beta 0.1, under one name they read as one metric; `dpo_state.run_logs.current_eval` reads older records so)."""


class Evaluator:
    """Scores a held-out store with the initial policy once (it is the reference), then with the policy.

    accuracy: share of pairs with (c - c0) - (r - r0) > 0 (a tie is not a win, so it is 0 before
    training, when policy = reference), logratio_margin the mean of that log-ratio margin; rewards/margins: the
    mean of the run's loss's chosen minus rejected reward (beta-scaled, TRL's `eval_rewards/margins` and
    metrics.jsonl's `rewards/margins`); logp_accuracy: share with c > r, the policy alone; loss: the run's
    objective over the held-out pairs (`held_out_metrics`), pair_loss its pair part, nll the NLL per chosen token.
    """

    def __init__(self, run: Run, initial: Any, scoring: Scoring):
        """`run.held_out`: the pairs; `run` (kept as `setting`: `run` is this class's verb) also gives the
        placement's autocast, the sequence mesh, the data layout, the loss, and whether each scoring is shown
        as a stage (`run.shown`); `scoring`: the run's (`Scoring`), the initial policy's and the policy's alike."""
        self.setting, self.store, self.loss, self.scoring = run, run.held_out, run.config.loss, scoring
        store = self.store
        self.budget = max(  # the largest held-out pair always fits: evaluation never skips one
            run.config.data.max_tokens_per_microbatch,
            int(store.segment_tokens(np.arange(store.num_pairs), run.config.data.layout).max(initial=0)),
        )
        self.reference = self._score(initial, weighting=False, stage="eval: the reference scores the held-out set")

    def _score(self, model: Any, weighting: bool, stage: str) -> Scores:
        shown = stage if self.setting.shown else None
        return score_pairs(model, self.scoring, self.store, self.setting, self.budget, weighting, shown)

    def run(self, model: Any, step: int) -> dict:
        """The eval.jsonl record of `model` after `step` optimizer steps (step 0: the reference itself)."""
        policy = self.reference  # step 0 without WPO weights: the policy is the reference
        if step or self.loss.use_weighting:
            stage = f"eval at step {step}: the policy scores the held-out set"
            policy = self._score(model, self.loss.use_weighting, stage)
        margin = (policy.chosen - self.reference.chosen) - (policy.rejected - self.reference.rejected)
        n = max(len(margin), 1)
        objective = held_out_metrics(self.loss, policy, self.reference)
        return {
            "format_version": EVAL_FORMAT_VERSION,
            "step": step,
            "pairs": int(len(margin)),
            "accuracy": float((margin > 0).sum() / n),
            "ties": float((margin == 0).sum() / n),
            "rewards/margins": objective["rewards/margins"],
            "logratio_margin": float(margin.sum() / n),
            "logp_accuracy": float((policy.chosen > policy.rejected).sum() / n),
            "loss": objective["loss"],
            "pair_loss": objective["pair_loss"],
            "nll": objective["nll"],
        }


def held_out_metrics(config: LossConfig, policy: Scores, reference: Scores) -> dict[str, float]:
    """loss, pair_loss, nll and rewards/margins: the training objective with the held-out set as one step, every
    pair weighing 1/N (the sorted types sort over the whole set: `pair_loss`), plus the NLL term's weight times
    `nll`, the NLL per chosen completion token; the router load-balancing loss, a regularizer of training and a
    statistic of how the pairs are packed, is left out. rewards/margins: the mean of the same terms' chosen minus
    rejected rewards, as `dpo_train.step.metrics` logs them for a step."""
    if not len(policy.chosen):
        return dict.fromkeys(("loss", "pair_loss", "nll", "rewards/margins"), float("nan"))
    policy_logps, reference_logps = policy.as_logps(), reference.as_logps()
    partners = None
    if sorted_types(config):
        pairs = torch.arange(len(policy.chosen))
        partners = set_partners(SortScores(pairs, *policy_logps.scored, *reference_logps.scored), config)
    terms = pair_losses(policy_logps, reference_logps, config, partners)
    nll = float(-policy.chosen.sum() / max(int(policy.chosen_tokens.sum()), 1))
    pair_loss = float(terms.losses.mean())
    margins = float((terms.chosen_rewards - terms.rejected_rewards).mean())
    return {"loss": pair_loss + config.sft_weight * nll, "pair_loss": pair_loss, "nll": nll, "rewards/margins": margins}
