"""Held-out preference accuracy: the share of held-out pairs whose margin over the reference is positive."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import orjson

from dpo_data.dataset.store import PairStore
from dpo_state.run_logs import EVAL_LOG
from dpo_train.errors import ConfigError
from dpo_train.scoring import Scores, score_pairs

EVAL_FORMAT_VERSION = 1
"""Every eval.jsonl record carries it; schema `eval-record`."""


class Evaluator:
    """Scores `eval.path` with the initial policy once (it is the reference), then with the policy.

    accuracy: share of pairs with (c - c0) - (r - r0) > 0 (a tie is not a win, so it is 0 before
    training, when policy = reference); logp_accuracy: share with c > r, the policy alone.
    """

    def __init__(self, config, trainer, out: Path, rank: int):
        self.store = PairStore([config.eval.path])
        train_tokenizer = trainer.tokenizer_fingerprint
        if self.store.tokenizer_fingerprint != train_tokenizer:
            raise ConfigError(
                f"eval.path {config.eval.path} was built with tokenizer {self.store.tokenizer_fingerprint}, "
                f"the training data with {train_tokenizer}; build it with the same tokenizer"
            )
        self.trainer, self.out, self.rank = trainer, out, rank
        self.budget = max(
            config.data.max_tokens_per_microbatch,
            int(self.store.segment_tokens(np.arange(self.store.num_pairs), config.data.layout).max(initial=0)),
        )
        self.reference = self._score(trainer.initial)

    def _score(self, model) -> Scores:
        trainer = self.trainer
        return score_pairs(
            model, self.store, self.budget, trainer.place.autocast, trainer.mesh, trainer.config.data.layout
        )

    def run(self, step: int) -> dict:
        policy = self.reference if step == 0 else self._score(self.trainer.model)
        margin = (policy.chosen - self.reference.chosen) - (policy.rejected - self.reference.rejected)
        n = max(len(margin), 1)
        record = {
            "format_version": EVAL_FORMAT_VERSION,
            "step": step,
            "pairs": int(len(margin)),
            "accuracy": float((margin > 0).sum() / n),
            "ties": float((margin == 0).sum() / n),
            "margin": float(margin.sum() / n),
            "logp_accuracy": float((policy.chosen > policy.rejected).sum() / n),
        }
        if self.rank == 0:
            with open(self.out / EVAL_LOG, "ab") as f:
                f.write(orjson.dumps(record) + b"\n")
        return record
