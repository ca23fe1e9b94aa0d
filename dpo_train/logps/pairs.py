"""Per-pair completion log-probabilities from one packed micro-batch (separate or shared-prompt layout)."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any

import torch
from transformers import modeling_utils

from dpo_data.loading.microbatch import IGNORE_INDEX, PackedRow, segment_sums, segments_to_pairs
from dpo_train.attention import rope, unpacked
from dpo_train.attention.inputs import passed_inputs, row_inputs
from dpo_train.logps import head
from dpo_train.logps.scoring import Scoring
from dpo_train.parallel import collectives


@dataclass
class PairLogps:
    """Summed completion log-probs per pair and the completion token counts."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    chosen_tokens: torch.Tensor
    rejected_tokens: torch.Tensor
    aux_loss: torch.Tensor | None = None  # the router load-balancing loss, when asked for
    ld: tuple[torch.Tensor, torch.Tensor] | None = None
    """(chosen, rejected) LD-DPO sums (`ld_alpha`), when asked for."""
    weights: torch.Tensor | None = None
    """WPO weights per pair (`weighting`), without gradient, when asked for."""

    @property
    def scored(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (chosen, rejected) log-probs the loss reads: the LD-DPO sums where asked for, else the sums."""
        return self.ld if self.ld is not None else (self.chosen, self.rejected)


@dataclass
class Targets:
    """Every completion token a row must predict: the position whose logits predict it, the token, and
    the segment it counts for, in position order within each kind."""

    position: torch.Tensor
    label: torch.Tensor
    segment: torch.Tensor


def targets(batch: PackedRow) -> Targets:
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


def ld_token_weights(every: Targets, batch: PackedRow, ld_alpha: float) -> torch.Tensor:
    """LD-DPO's weight of each target (TRL's `ld_alpha`): 1 for the first min(|chosen|, |rejected|) tokens of
    its completion, ld_alpha for the rest. It depends only on the token's index within its completion and its
    pair's two lengths, so it is the same whatever the packing, and a sequence-parallel rank can weigh its
    own targets. Targets are in position order within each kind, and a shared-prompt completion's first
    token is predicted by its prompt's last position, before the completion's own: so sorting a segment's
    targets by position gives their order in the completion."""
    segments = len(batch["segment_length"])
    tokens = torch.bincount(every.segment, minlength=segments)
    order = torch.argsort(every.segment * batch["labels"].shape[1] + every.position)  # positions < row length
    index = torch.empty_like(order)
    index[order] = (
        torch.arange(len(order), device=order.device) - (torch.cumsum(tokens, 0) - tokens)[every.segment[order]]
    )
    shared = segments_to_pairs(tokens, batch).min(dim=1).values  # per pair
    pair = batch["segment_pair"].long().to(every.segment.device)[every.segment]
    return torch.where(index < shared[pair], 1.0, float(ld_alpha))


def wpo_weights(aligned: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """WPO's pair weight (Zhou et al. 2024, Eq. 2, as TRL 1.16's `use_weighting`): exp of each completion's mean
    over its tokens of log p(token) - log sum_v p(v)^2, chosen's times rejected's. `aligned` [pairs, 2]: those
    sums; `tokens` [pairs, 2]: the completion token counts."""
    weights = torch.exp(aligned / tokens.to(aligned.dtype).clamp(min=1))
    return weights[:, 0] * weights[:, 1]


def logits_mask(keep: torch.Tensor, shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits_to_keep` for the positions `keep` (flat, row-major over `shape`), and the positions it keeps.

    A one-row batch (a packed row) passes `keep` itself: every transformers release slices
    `hidden_states[:, keep]` with a 1-D mask. A padded batch passes its 2-D mask where transformers has
    `slice_logits_to_keep` (the heads then keep exactly those positions); older releases index
    `hidden_states[:, mask]` and cannot take one, so they get the columns any row keeps, in every row."""
    if shape[0] == 1:
        return keep, keep
    if hasattr(modeling_utils, "slice_logits_to_keep"):
        return keep.view(shape), keep
    columns = keep.view(shape).any(0)
    return columns, columns.expand(shape).reshape(-1)


def pair_logps(
    model: Any,
    batch: PackedRow,
    scoring: Scoring,
    mesh: Any = None,
    router_aux: bool = False,
    ld_alpha: float | None = None,
    weighting: bool = False,
) -> PairLogps:
    """Forward one packed row and sum completion log-probs per pair, as the run's `scoring` says: a model packing
    cannot serve (`scoring.unpacked`, `dpo_train.attention.unpacked`) runs the row as a padded batch of its
    sequences instead (the sums are the same), and a head whose logits would pass `scoring.logits_budget` runs in
    chunks (`head.target_logps`).

    The vocabulary projection runs only at the positions that predict a target (`logits_to_keep` with a
    boolean mask): prompt positions never need logits, and on a 135M model the projection is a fifth of
    the forward. With a sequence-parallel `mesh` (dpo_train.attention.sequence_parallel) this rank forwards its
    positions only and scores the targets they predict; the per-pair sums are completed over its group,
    so every rank of the group returns the whole sums. `router_aux`: also return the model's router
    load-balancing loss (a mixture-of-experts model's `aux_loss`; on the unpacked path over the padded
    batch's real tokens, a shared prompt counted once per completion). `ld_alpha`: also the LD-DPO sums
    (`ld_token_weights`); `weighting`: also the WPO pair weights (`wpo_weights`).
    """
    device = batch["input_ids"].device
    every = targets(batch)
    view = unpacked.unpack(batch) if scoring.unpacked else None
    if view is not None:  # one sequence per row: a packed position becomes its place in the padded batch
        passed_inputs(batch, "unpacked")
        inputs, shard = dict(view.inputs), None
        mine = torch.ones_like(every.position, dtype=torch.bool)
        label, segment = every.label, every.segment
        position, keep = view.keep(every.position, every.segment)
        keep_shape = view.shape
    else:
        inputs, shard = row_inputs(batch, mesh, model)  # packed: the unpacked view is above
        start, stop = (shard.start, shard.stop) if shard is not None else (0, batch["input_ids"].shape[1])
        mine = (every.position >= start) & (every.position < stop)
        position, label, segment = every.position[mine] - start, every.label[mine], every.segment[mine]
        keep = torch.zeros(stop - start, dtype=torch.bool, device=device)
        keep[position] = True
        keep_shape = (1, stop - start)
    if router_aux:
        inputs["output_router_logits"] = True
    keep, kept = logits_mask(keep, keep_shape)
    chunk = head.chunk_rows(model, int(kept.sum()), scoring.logits_budget)  # None: the model's own head, all at once
    lengths = lambda: view.lengths if view is not None else rope.shard_lengths(batch, shard)  # noqa: E731
    with (
        head.HeadInput(model) if chunk else contextlib.nullcontext() as captured,
        rope.sequence_lengths(model, lengths),
    ):
        output = model(**inputs, logits_to_keep=keep)
    scores = captured.hidden if chunk else output.logits  # the final hidden states, or the logits
    # [N, L, -] if the model ignored the mask (flattened: the row-major order of `kept`), else [kept, -]
    scores = scores.reshape(-1, scores.shape[-1]) if scores.dim() == 3 else scores
    rows = torch.cumsum(kept, 0)[position] - 1 if scores.shape[0] != kept.shape[0] else position
    if chunk:
        picked, log_sum_sq = head.target_logps(
            scores[rows], captured.head, label, chunk, squares=weighting, compiled=scoring.compiled_head
        )
    else:
        logits = scores.to(torch.promote_types(scores.dtype, torch.float32))  # bf16 to float32; float64 stays
        log_z = torch.logsumexp(logits, dim=-1)
        picked = logits[rows, label] - log_z[rows]

    def pair_sums(values: torch.Tensor) -> torch.Tensor:
        """Per-target values summed per pair [pairs, 2], over the sequence-parallel group too."""
        sums = segments_to_pairs(segment_sums(values, segment, len(batch["segment_length"])), batch)
        return collectives.sum_same_loss(sums, mesh.group) if shard is not None else sums

    sums = pair_sums(picked)
    counts = segments_to_pairs(torch.bincount(every.segment, minlength=len(batch["segment_length"])).float(), batch)
    ld = None
    if ld_alpha is not None:
        ld = pair_sums(picked * ld_token_weights(every, batch, ld_alpha)[mine].to(picked.dtype)).unbind(1)
    weights = None
    if weighting:
        with torch.no_grad():  # WPO's weights carry no gradient (TRL computes them under no_grad too)
            if not chunk:
                log_sum_sq = (torch.logsumexp(2 * logits, dim=-1) - 2 * log_z)[rows]  # log sum_v p(v)^2
            weights = wpo_weights(pair_sums(picked - log_sum_sq), counts)
    aux = getattr(output, "aux_loss", None) if router_aux else None
    return PairLogps(sums[:, 0], sums[:, 1], counts[:, 0], counts[:, 1], aux, ld, weights)
