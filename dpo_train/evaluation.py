"""Held-out preference accuracy: the share of held-out pairs whose margin over the reference is positive."""

from __future__ import annotations

from typing import Any

import numpy as np

from dpo_data.dataset.store import PairStore
from dpo_train.reference.scoring import Scores, score_pairs

EVAL_FORMAT_VERSION = 1
"""Every eval.jsonl record carries it; schema `eval-record`."""


class Evaluator:
    """Scores a held-out store with the initial policy once (it is the reference), then with the policy.

    accuracy: share of pairs with (c - c0) - (r - r0) > 0 (a tie is not a win, so it is 0 before
    training, when policy = reference); logp_accuracy: share with c > r, the policy alone.
    """

    def __init__(self, store: PairStore, initial: Any, setup: Any):
        """`setup` (a RunSetup) gives the placement's autocast, the sequence mesh and the data layout."""
        self.store, self.setup, self.layout = store, setup, setup.config.data.layout
        self.budget = max(  # the largest held-out pair always fits: evaluation never skips one
            setup.config.data.max_tokens_per_microbatch,
            int(store.segment_tokens(np.arange(store.num_pairs), self.layout).max(initial=0)),
        )
        self.reference = self._score(initial)

    def _score(self, model: Any) -> Scores:
        return score_pairs(model, self.store, self.budget, self.setup.place.autocast, self.setup.mesh, self.layout)

    def run(self, model: Any, step: int) -> dict:
        """The eval.jsonl record of `model` after `step` optimizer steps (step 0: the reference itself)."""
        policy = self.reference if step == 0 else self._score(model)
        margin = (policy.chosen - self.reference.chosen) - (policy.rejected - self.reference.rejected)
        n = max(len(margin), 1)
        return {
            "format_version": EVAL_FORMAT_VERSION,
            "step": step,
            "pairs": int(len(margin)),
            "accuracy": float((margin > 0).sum() / n),
            "ties": float((margin == 0).sum() / n),
            "margin": float(margin.sum() / n),
            "logp_accuracy": float((policy.chosen > policy.rejected).sum() / n),
        }
