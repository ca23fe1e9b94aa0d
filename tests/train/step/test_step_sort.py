"""AOT's sorts span the optimizer step: the same loss and gradient whatever its micro-batches and ranks."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from dpo_train.logps.pairs import PairLogps
from dpo_train.reference.choice import ReferenceLogps
from dpo_train.step.loss import LossConfig, pair_losses
from dpo_train.step.objective import microbatch_loss
from dpo_train.step.sort import SortScores, step_partners
from tests.harness import TINY_LLAMA, join_gloo, spawn, tiny_trainer

PAIRS = 7
SPLIT = [1, 0, 4, 2]
"""Micro-batch sizes of one rank's step: uneven, one without pairs."""


def _values() -> list[torch.Tensor]:
    """Policy and reference log-probs (c, r, c0, r0) of the step's pairs, with two equal policy margins."""
    torch.manual_seed(3)
    c, r, c0, r0 = (-5 - 5 * torch.rand(PAIRS, dtype=torch.float64) for _ in range(4))
    c[4], r[4] = c[1] + 1.0, r[1] + 1.0  # pairs 1 and 4: the same policy margin c - r, a tie in aot's sort
    return [c, r, c0, r0]


def _sorted_loss(name: str, c, r, c0, r0, beta: float = 0.5, e: float = 0.1) -> torch.Tensor:
    """TRL 1.16's batch loss: mean over k of l(b delta_(k)), the k-th smallest meeting the k-th smallest."""
    first, second = (c - r, c0 - r0) if name == "aot" else (c - c0, r - r0)
    delta = torch.sort(first).values - torch.sort(second).values
    return (-(1 - e) * F.logsigmoid(beta * delta) - e * F.logsigmoid(-beta * delta)).mean()


def _scores(values: list[torch.Tensor], index: torch.Tensor, sizes: list[int]) -> list[SortScores | None]:
    """The pairs `index` as micro-batches of `sizes` (0: a micro-batch without pairs)."""
    parts, start = [], 0
    for size in sizes:
        part = index[start : start + size]
        parts.append(SortScores(part, *(v[part] for v in values)) if size else None)
        start += size
    return parts


def _step_loss(config: LossConfig, values: list[torch.Tensor], scores: list, partners: list) -> torch.Tensor:
    """The trainer's step loss: each micro-batch's pair losses over the step's pair count, summed."""
    total = torch.zeros((), dtype=torch.float64)
    for part, found in zip(scores, partners, strict=True):
        if part is None:
            continue
        c, r, c0, r0 = (v[part.pair_index] for v in values)
        ones = torch.ones(len(c), dtype=torch.long)
        terms = pair_losses(PairLogps(c, r, ones, ones), ReferenceLogps(c0, r0), config, partners=found)
        total = total + microbatch_loss(terms.losses, PAIRS)
    return total


def _gradients(loss: torch.Tensor, values: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, values[:2]))


@pytest.mark.parametrize("name", ["aot", "aot_unpaired"])
def test_micro_batches_give_the_whole_steps_sort_and_its_gradient(name):
    """Split unevenly and shuffled, the step's loss and the gradient of every pair's log-probs equal the
    whole step's sort through autograd; partners found per micro-batch (TRL's batch is its own micro-batch)
    give another loss."""
    config = LossConfig(type=name, beta=0.5, label_smoothing=0.1)
    values = [v.requires_grad_() for v in _values()]
    whole = _sorted_loss(name, *values)
    order = torch.randperm(PAIRS, generator=torch.Generator().manual_seed(1))
    scores = _scores(values, order, SPLIT)
    ours = _step_loss(config, values, scores, step_partners(scores, config))
    torch.testing.assert_close(ours, whole, rtol=1e-12, atol=0)
    for got, want in zip(_gradients(ours, values), _gradients(whole, values), strict=True):
        torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-15)
    alone = [step_partners([part], config)[0] for part in scores]  # each micro-batch sorted on its own
    assert abs(_step_loss(config, values, scores, alone).item() - whole.item()) > 1e-4


def test_ties_are_ordered_by_pair_index_whatever_the_packing():
    """Pairs 1 and 4 have the same policy margin: each keeps its partner in any order of the step's pairs."""
    config = LossConfig(type="aot")
    values = _values()

    def by_pair(order: torch.Tensor) -> torch.Tensor:
        scores = _scores(values, order, [PAIRS])
        found = torch.cat([p["aot"] for p in step_partners(scores, config)])
        return found[torch.argsort(order)]

    forward = by_pair(torch.arange(PAIRS))
    assert forward[1, 0] != forward[4, 0]  # the tie matters: the two pairs meet different reference margins
    torch.testing.assert_close(by_pair(torch.arange(PAIRS).flip(0)), forward, rtol=0, atol=0)


def _ranks_worker(rank: int, world: int, port: int, expected: dict) -> None:
    """Rank 0 holds pairs 0-3, rank 1 pairs 4-6 and a micro-batch without pairs; then both ranks as one
    sequence-parallel group (the same pairs, only rank 0 sending them)."""
    join_gloo(rank, world, port)
    try:
        _check_ranks(rank, expected)
    finally:
        torch.distributed.destroy_process_group()  # gloo's threads stop before exit (else SIGABRT)


def _check_ranks(rank: int, expected: dict) -> None:
    values = _values()
    mine = torch.arange(4) if rank == 0 else torch.arange(4, PAIRS)
    data_parallel = types.SimpleNamespace(dp_rank=rank, counts_pairs=True)
    group = types.SimpleNamespace(dp_rank=0, counts_pairs=rank == 0)
    for name, want in expected.items():
        config = LossConfig(type=name)
        found = step_partners(_scores(values, mine, [2, 2] if rank == 0 else [0, 3]), config, data_parallel)
        torch.testing.assert_close(torch.cat([p[name] for p in found]), want[mine], rtol=0, atol=0)
        shared = step_partners(_scores(values, torch.arange(PAIRS), [3, 4]), config, group)
        torch.testing.assert_close(torch.cat([p[name] for p in shared]), want, rtol=0, atol=0)


def test_ranks_find_the_partners_one_process_finds():
    """Two gloo ranks with uneven pairs, and a two-rank sequence-parallel group: every rank's partners are
    the one-process step's for its pairs, for both sorted types."""
    values = _values()
    expected = {}
    for name in ("aot", "aot_unpaired"):
        scores = _scores(values, torch.arange(PAIRS), [PAIRS])
        expected[name] = step_partners(scores, LossConfig(type=name))[0][name]
    spawn(_ranks_worker, 2, expected)


def _config(dataset, **model) -> dict:
    return {
        "model": {"init": {"config": TINY_LLAMA, "seed": 0}, **model},
        "data": {"path": str(dataset)},
        "loss": {"type": ["aot", "aot_unpaired"], "beta": 2.0},
        "optim": {"lr": 0.05},  # a step that reorders the pairs' log-ratios
        "train": {"output_dir": "unused"},
        "distributed": {"device": "cpu"},
    }


def _step(trainer, pairs: list, split: list[int]) -> None:
    """One optimizer step's micro-batches (sizes `split`) through `Trainer.microbatch`."""
    from dpo_data.loading.microbatch import pack_microbatch

    tokens, start = sum(len(p.chosen) for p in pairs), 0
    for m, size in enumerate(split):
        batch = pack_microbatch(pairs[start : start + size], pad_to_multiple_of=8)
        batch.update(microbatch=m, microbatches_in_step=len(split), step_pairs=len(pairs), step_chosen_tokens=tokens)
        trainer.microbatch(batch)
        start += size


def test_the_trainer_sorts_over_its_steps_micro_batches(sample_dataset, monkeypatch):
    """A trained step (the policy no longer orders pairs as the reference) of [aot, aot_unpaired] gives the
    same next gradient as one micro-batch or three; and the pass without gradient leaves the RNG where it
    was, so that LoRA dropout draws the step's masks as it would without the pass."""
    trainer = tiny_trainer(_config(sample_dataset))
    pairs = [trainer.store.pair(i) for i in range(6)]
    for _ in range(2):
        _step(trainer, pairs, [6])
        trainer.step()  # now the policy orders the pairs' margins otherwise than the reference

    def gradient(split):
        _step(trainer, pairs, split)
        grads = torch.cat([p.grad.flatten() for p in trainer.policy.parameters()])
        trainer.optimizer.zero_grad(set_to_none=True)
        return grads

    whole = gradient([6])
    torch.testing.assert_close(gradient([2, 3, 1]), whole, rtol=1e-4, atol=1e-6)
    import dpo_train.trainer

    def alone(scores, loss, mesh):  # the broken variant: each micro-batch sorted on its own, as TRL's batch is
        return [step_partners([part], loss, mesh)[0] for part in scores]

    monkeypatch.setattr(dpo_train.trainer, "step_partners", alone)
    assert (gradient([2, 3, 1]) - whole).abs().max() > 100 * 1e-6, "the check cannot tell"

    lora = tiny_trainer(_config(sample_dataset, lora={"r": 4, "dropout": 0.5}))
    before = torch.get_rng_state()
    scores = lora._step_partners([_packed(pairs)])
    assert torch.equal(torch.get_rng_state(), before) and len(scores) == 1


def _packed(pairs: list) -> dict:
    from dpo_data.loading.microbatch import pack_microbatch

    batch = pack_microbatch(pairs, pad_to_multiple_of=8)
    batch.update(microbatch=0, microbatches_in_step=1, step_pairs=len(pairs), step_chosen_tokens=1)
    return batch
