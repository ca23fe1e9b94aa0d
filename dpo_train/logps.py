"""Per-pair completion log-probabilities from one packed micro-batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dpo_data.loading.microbatch import IGNORE_INDEX, pair_sums


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
    `logits` is [T, V] for every position, or [M, V] for the M supervised positions only.
    """
    mask = labels != IGNORE_INDEX
    selected = (logits[mask] if logits.shape[0] == labels.shape[0] else logits).float()
    picked = selected.gather(-1, labels[mask, None])[:, 0] - torch.logsumexp(selected, dim=-1)
    out = torch.zeros(labels.shape, dtype=torch.float32, device=logits.device)
    return out.masked_scatter(mask, picked)


def pair_logps(model: Any, batch: dict[str, Any]) -> PairLogps:
    """Forward one packed row and sum completion log-probs per pair.

    On CPU with sdpa/eager attention, transformers keeps packed segments apart when it gets
    `position_ids` restarting at 0, no attention mask and `use_cache=False` (it then detects the packed
    documents from the position restarts; with a mask, segments would attend across each other).
    The vocabulary projection runs only at supervised positions (`logits_to_keep` with a boolean
    mask): prompt positions never need logits, and on a 135M model the projection is a fifth of the
    forward.
    """
    labels = batch["labels"][0].to(batch["input_ids"].device)
    mask = labels != IGNORE_INDEX
    logits = model(
        input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False, logits_to_keep=mask[None]
    ).logits
    logits = logits[0] if logits.dim() == 3 else logits  # [T, V] if the model ignored the mask, else [M, V]
    sums = pair_sums(token_logps(logits, labels), batch)
    counts = pair_sums(mask.float(), batch)
    return PairLogps(sums[:, 0], sums[:, 1], counts[:, 0], counts[:, 1])
