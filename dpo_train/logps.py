"""Per-pair completion log-probabilities from one packed micro-batch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dpo_data.loading.microbatch import IGNORE_INDEX, pair_sums
from dpo_train import collectives
from dpo_train.sequence_parallel import complete_sums, split_row


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


def row_inputs(batch: dict[str, Any], mesh: Any = None) -> tuple[dict[str, Any], torch.Tensor, Any]:
    """The model's keyword inputs for this rank's part of the row (all of it without sequence
    parallelism), its labels, and its sequence shard (None without sequence parallelism)."""
    if mesh is None or not mesh.active:
        inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
        return inputs, batch["labels"][0].to(batch["input_ids"].device), None
    part, shard = split_row(batch, mesh)
    inputs = {"input_ids": part["input_ids"], "position_ids": part["position_ids"], "use_cache": False}
    return {**inputs, "sequence_shard": shard}, part["labels"], shard


def pair_logps(model: Any, batch: dict[str, Any], mesh: Any = None) -> PairLogps:
    """Forward one packed row and sum completion log-probs per pair.

    On CPU with sdpa/eager attention, transformers keeps packed segments apart when it gets
    `position_ids` restarting at 0, no attention mask and `use_cache=False` (it then detects the packed
    documents from the position restarts; with a mask, segments would attend across each other).
    The vocabulary projection runs only at supervised positions (`logits_to_keep` with a boolean
    mask): prompt positions never need logits, and on a 135M model the projection is a fifth of the
    forward.

    With a sequence-parallel `mesh` (dpo_train.sequence_parallel), this rank forwards its positions only
    and the per-pair sums are completed over its group: every rank of the group returns the whole sums.
    """
    inputs, labels, shard = row_inputs(batch, mesh)
    mask = labels != IGNORE_INDEX
    logits = model(**inputs, logits_to_keep=mask[None]).logits
    logits = logits[0] if logits.dim() == 3 else logits  # [T, V] if the model ignored the mask, else [M, V]
    tokens = token_logps(logits, labels)
    if shard is None:
        sums = pair_sums(tokens, batch)
    else:
        sums = collectives.sum_same_loss(pair_sums(complete_sums(tokens, shard), batch), mesh.group)
    counts = pair_sums((batch["labels"][0] != IGNORE_INDEX).float().to(sums.device), batch)
    return PairLogps(sums[:, 0], sums[:, 1], counts[:, 0], counts[:, 1])
