"""AOT's sorts over the optimizer step: each pair's partners in them, from a pass without gradient first."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dpo_train.parallel import collectives
from dpo_train.step.loss import LossConfig, loss_type


@dataclass
class SortScores:
    """One micro-batch's pairs as the pass without gradient scored them (the sums the loss reads)."""

    pair_index: torch.Tensor
    chosen: torch.Tensor
    rejected: torch.Tensor
    ref_chosen: torch.Tensor
    ref_rejected: torch.Tensor


def unmoved_rng(device: torch.device):
    """The pass without gradient draws what the step's forwards will draw again (LoRA dropout): it runs on a
    fork of the RNG, so that they draw the same numbers as without it."""
    if device.type == "cpu":
        return torch.random.fork_rng(devices=[])
    return torch.random.fork_rng(devices=[device.index or 0], device_type=device.type)


def sorted_types(loss: LossConfig) -> list[str]:
    """The listed types whose loss pairs the step's sorted log-ratios (`LossType.sorted`)."""
    return [name for name in loss.types if loss_type(name).sorted]


def sort_columns(name: str, scores: SortScores) -> torch.Tensor:
    """[pairs, 2] float64: the two quantities `name` sorts, each on its own: aot the policy and reference
    margins (c - r, c0 - r0), aot_unpaired the chosen and rejected log-ratios (c - c0, r - r0)."""
    values = (scores.chosen, scores.rejected, scores.ref_chosen, scores.ref_rejected)
    c, r, c0, r0 = (v.detach().double().cpu() for v in values)
    return torch.stack([c - r, c0 - r0] if name == "aot" else [c - c0, r - r0], dim=1)


def _ranks(values: torch.Tensor, ties: torch.Tensor) -> torch.Tensor:
    """Each value's place in the ascending order, equal values ordered by `ties` (the pair index), so that
    the order is the same whatever the micro-batches and ranks the pairs came in."""
    order = torch.argsort(ties, stable=True)
    order = order[torch.argsort(values[order], stable=True)]
    ranks = torch.empty_like(order)
    ranks[order] = torch.arange(len(order))
    return ranks


def partners_in_sorts(columns: torch.Tensor, ties: torch.Tensor) -> torch.Tensor:
    """[N, 2]: for each row, the second column's value at the first's rank in the first column's sort,
    and the first column's value at the second's rank in the second's: the k-th smallest meets the k-th
    smallest."""
    first, second = columns.unbind(1)
    rank_first, rank_second = _ranks(first, ties), _ranks(second, ties)
    sorted_first, sorted_second = torch.empty_like(first), torch.empty_like(second)
    sorted_first[rank_first], sorted_second[rank_second] = first, second
    return torch.stack([sorted_second[rank_first], sorted_first[rank_second]], dim=1)


def form_partners(name: str, columns: torch.Tensor, partners: torch.Tensor) -> torch.Tensor:
    """The partners as `name`'s form reads them (dpo_train/step/loss.py): aot the shift y - y_(rank of x) of its
    margin, aot_unpaired the partners themselves."""
    if name == "aot":
        return torch.stack([columns[:, 1] - partners[:, 0], torch.zeros_like(partners[:, 0])], dim=1)
    return partners


def step_partners(scores: list[SortScores | None], loss: LossConfig, mesh=None) -> list[dict[str, torch.Tensor]]:
    """Each micro-batch's partners per sorted type, over the whole optimizer step: this rank's micro-batches
    (None: one without pairs) and every data-parallel rank's, gathered in one collective. Under sequence
    parallelism (`mesh`, a SequenceMesh; None: one process) one rank of each group sends its group's pairs,
    and every rank of the group takes them back by its data-parallel rank."""
    dp_rank, sends = (0, True) if mesh is None else (mesh.dp_rank, mesh.counts_pairs)
    names, held = sorted_types(loss), [s for s in scores if s is not None]
    rows = _rows(held, names, dp_rank) if held and sends else torch.zeros(0, 2 + 2 * len(names), dtype=torch.float64)
    found = _partners(collectives.all_gather_rows(rows), names, dp_rank)
    return _split(found, names, [0 if s is None else len(s.pair_index) for s in scores])


def set_partners(scores: SortScores, loss: LossConfig) -> dict[str, torch.Tensor]:
    """The partners of a whole set of pairs that this process holds (held-out evaluation): no collective."""
    names = sorted_types(loss)
    return _split(_partners(_rows([scores], names, 0), names, 0), names, [len(scores.pair_index)])[0]


def _rows(held: list[SortScores], names: list[str], dp_rank: int) -> torch.Tensor:
    """[pairs, 2 + 2 * types] float64: data-parallel rank, pair index, then each sorted type's two columns."""
    ties = torch.cat([s.pair_index.double().cpu() for s in held])
    columns = [torch.cat([sort_columns(name, s) for s in held]) for name in names]
    return torch.cat([torch.full_like(ties, dp_rank)[:, None], ties[:, None], *columns], dim=1)


def _partners(step: torch.Tensor, names: list[str], dp_rank: int) -> dict[str, torch.Tensor]:
    """Each type's partners of the rows of `dp_rank`, in their order, sorted over all of `step`'s rows."""
    mine, found = step[:, 0] == dp_rank, {}
    for k, name in enumerate(names):
        columns = step[:, 2 + 2 * k : 4 + 2 * k]
        found[name] = form_partners(name, columns, partners_in_sorts(columns, step[:, 1]))[mine]
    return found


def _split(found: dict[str, torch.Tensor], names: list[str], sizes: list[int]) -> list[dict[str, torch.Tensor]]:
    split = {name: found[name].split(sizes) for name in names}
    return [{name: split[name][m] for name in names} for m in range(len(sizes))]
