"""Per-pair completion log-probabilities from one packed micro-batch (separate or shared-prompt layout)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dpo_data.loading.microbatch import IGNORE_INDEX, segments_to_pairs
from dpo_train.attention.inputs import row_inputs
from dpo_train.parallel import collectives


@dataclass
class PairLogps:
    """Summed completion log-probs per pair and the completion token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    aux_loss: torch.Tensor | None = None  # the router load-balancing loss, when asked for


@dataclass
class Targets:
    """Every completion token a row must predict: the position whose logits predict it, the token, and
    the segment it counts for, in position order within each kind."""

    position: torch.Tensor
    label: torch.Tensor
    segment: torch.Tensor


def targets(batch: dict[str, Any]) -> Targets:
    """The row's targets. Labels are pre-shifted by the loader: position t predicts `labels[t]`, a token
    of t's own segment. In the shared-prompt layout the first token of each completion is predicted by
    the last position of its prompt segment (`segment_first_label`), which both completions share, so
    that position carries two targets."""
    labels = batch["labels"][0]
    lengths = batch["segment_length"].long().to(labels.device)
    segment_of_token = torch.repeat_interleave(torch.arange(len(lengths), device=labels.device), lengths)
    position = torch.nonzero(labels != IGNORE_INDEX)[:, 0]
    label, segment = labels[position], segment_of_token[position]
    if "segment_first_label" in batch:
        first = batch["segment_first_label"].long().to(labels.device)
        opened = torch.nonzero(first != IGNORE_INDEX)[:, 0]  # completion segments
        context = batch["segment_context"].long().to(labels.device)[opened]
        prompt_last = batch["cu_seqlens"].long().to(labels.device)[context + 1] - 1
        position = torch.cat([position, prompt_last])
        label, segment = torch.cat([label, first[opened]]), torch.cat([segment, opened])
    return Targets(position, label, segment)


def pair_logps(model: Any, batch: dict[str, Any], mesh: Any = None, router_aux: bool = False) -> PairLogps:
    """Forward one packed row and sum completion log-probs per pair.

    The vocabulary projection runs only at the positions that predict a target (`logits_to_keep` with a
    boolean mask): prompt positions never need logits, and on a 135M model the projection is a fifth of
    the forward. With a sequence-parallel `mesh` (dpo_train.sequence_parallel) this rank forwards its
    positions only and scores the targets they predict; the per-pair sums are completed over its group,
    so every rank of the group returns the whole sums. `router_aux`: also return the model's router
    load-balancing loss (a mixture-of-experts model's `aux_loss`).
    """
    inputs, shard = row_inputs(batch, mesh, model)
    device = batch["input_ids"].device
    every = targets(batch)
    start, stop = (shard.start, shard.stop) if shard is not None else (0, batch["input_ids"].shape[1])
    mine = (every.position >= start) & (every.position < stop)
    position, label, segment = every.position[mine] - start, every.label[mine], every.segment[mine]
    keep = torch.zeros(stop - start, dtype=torch.bool, device=device)
    keep[position] = True
    if router_aux:
        inputs["output_router_logits"] = True
    output = model(**inputs, logits_to_keep=keep[None])
    logits = output.logits
    logits = logits[0] if logits.dim() == 3 else logits  # [T, V] if the model ignored the mask, else [M, V]
    rows = torch.cumsum(keep, 0)[position] - 1 if logits.shape[0] != keep.shape[0] else position
    logits = logits.float()
    picked = logits[rows, label] - torch.logsumexp(logits, dim=-1)[rows]
    segments = len(batch["segment_length"])
    per_segment = torch.zeros(segments, dtype=picked.dtype, device=picked.device).index_add(0, segment, picked)
    sums = segments_to_pairs(per_segment, batch)
    if shard is not None:
        sums = collectives.sum_same_loss(sums, mesh.group)
    ones = torch.ones_like(every.segment, dtype=torch.float32)
    counts = segments_to_pairs(torch.zeros(segments, device=device).index_add(0, every.segment, ones), batch)
    aux = getattr(output, "aux_loss", None) if router_aux else None
    return PairLogps(sums[:, 0], sums[:, 1], counts[:, 0], counts[:, 1], aux)
