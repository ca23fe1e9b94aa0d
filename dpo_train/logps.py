"""Per-pair completion log-probabilities from one packed micro-batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dpo_data.microbatch import IGNORE_INDEX, pair_sums


@dataclass
class PairLogps:
    """Summed completion log-probs per pair and the completion token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor


def token_logps(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels[t] | logits[t]) per position, 0 where labels[t] is the ignore index.

    Labels are pre-shifted by the loader (position t predicts labels[t]), so no shift happens here.
    """
    mask = labels != IGNORE_INDEX
    out = torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
    picked = torch.log_softmax(logits[mask].float(), dim=-1).gather(-1, labels[mask, None])[:, 0]
    return out.masked_scatter(mask, picked)


def pair_logps(model: Any, batch: dict[str, Any]) -> PairLogps:
    """Forward one packed row and sum completion log-probs per pair.

    On CPU with sdpa/eager attention, transformers keeps packed segments apart when it gets
    `position_ids` restarting at 0, no attention mask and `use_cache=False` (REFERENCE.md §3).
    """
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
    labels = batch["labels"][0].to(logits.device)
    sums = pair_sums(token_logps(logits, labels), batch)
    counts = pair_sums((labels != IGNORE_INDEX).float(), batch)
    return PairLogps(sums[:, 0], sums[:, 1], counts[:, 0], counts[:, 1])
