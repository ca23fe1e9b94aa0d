"""The start-up check that the chunked vocabulary head stands in for a model's own, and the note where it cannot."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch

from dpo_data.loading.microbatch import pack_microbatch, pack_shared_prompt
from dpo_data.progress import say
from dpo_train.attention.choice import checkable
from dpo_train.attention.features import attention_as, text_config
from dpo_train.logps.head import COPIES, causal_lm, head_of
from dpo_train.logps.pairs import pair_logps
from dpo_train.logps.probe import probe_pairs
from dpo_train.logps.scoring import Scoring


def check_head(model: Any, scoring: Scoring, layout: str = "separate") -> str | None:
    """Why the chunked head cannot stand in for `model`'s own, or None when it can: `head_of` reads the head, and
    the start-up probe's pairs (`probe.probe_pairs`), scored by `pair_logps` as `scoring` says (its logits budget
    aside) through the run's attention path and `layout`, sum to the same log-probs through the chunked head
    (chunks of 5 positions) as through the model's own head (whatever that applies after the projection), within
    1e-5 relative. Runs in this process alone, so a run's attention that needs a group or a device is swapped for
    the segment attention (`choice.checkable`): the head is what is checked."""
    head = head_of(causal_lm(model))
    if head is None:
        kind = type(causal_lm(model).get_output_embeddings()).__name__
        return f"its output embedding is a {kind}, not a plain Linear"
    pack = pack_shared_prompt if layout == "shared_prompt" else pack_microbatch
    batch = pack(probe_pairs(model), pad_to_multiple_of=8)
    sums = []
    config, training = text_config(model), model.training  # a vision-language model: its decoder's
    model.eval()
    try:
        with attention_as(config, checkable(config._attn_implementation)), torch.no_grad():
            for budget in (None, 5 * COPIES * head.weight.shape[0] * 4):
                out = pair_logps(model, batch, dataclasses.replace(scoring, logits_budget=budget))
                sums.append(torch.stack([out.chosen, out.rejected]).double())
    finally:
        model.train(training)
    own, chunked = sums
    error = float(((chunked - own).abs() / own.abs().clamp(min=1e-6)).max())
    if not error <= 1e-5:  # NaN too: a chunked path that produces NaN is not equal
        return f"on the probe's pairs its own head differs from the chunked one by {error:.1e} (relative)"
    return None


def note(model: Any, why: str) -> None:
    """The one stderr line saying the chunked head is off for this model (rank 0 only under torchrun)."""
    if os.environ.get("RANK", "0") == "0":
        say(
            f"note: {type(causal_lm(model)).__name__}: the chunked vocabulary head is off for this model ({why}); its "
            "own head scores every micro-batch, holding all of its logits at once (train.logits_budget_mib, "
            "docs/train-config.md)"
        )
