"""The step gradient is the gradient of the mean loss over the step's pairs: whatever the micro-batching,
and across ranks with DDP on gloo (real processes)."""

from __future__ import annotations

import contextlib

import pytest
import torch
import torch.multiprocessing as mp

from dpo_train.logps.pairs import PairLogps
from dpo_train.reference.choice import ReferenceLogps
from dpo_train.step.loss import LossConfig, pair_losses
from dpo_train.step.objective import microbatch_loss
from tests.harness import join_gloo, spawn

torch.manual_seed(0)
N_PAIRS = 6
FEATURES = torch.randn(N_PAIRS, 2, 4)  # per pair: chosen and rejected "sequence" features
REF = torch.randn(N_PAIRS, 2)
SPLITS = [[0], [1, 2, 3], [4, 5]]  # uneven micro-batches: 1, 3 and 2 pairs


def make_model():
    torch.manual_seed(1)
    return torch.nn.Linear(4, 1, bias=False)


def losses_for(model, idx):
    logps = model(FEATURES[idx]).squeeze(-1)  # [n, 2]: a stand-in for summed completion log-probs
    n = torch.ones(len(idx))
    policy, reference = PairLogps(logps[:, 0], logps[:, 1], n, n), ReferenceLogps(REF[idx, 0], REF[idx, 1])
    return pair_losses(policy, reference, LossConfig(beta=0.5)).losses


def full_step_gradient():
    model = make_model()
    losses_for(model, list(range(N_PAIRS))).mean().backward()
    return model.weight.grad.clone()


def test_accumulated_micro_batches_give_the_step_mean_gradient():
    model = make_model()
    for idx in SPLITS:
        microbatch_loss(losses_for(model, idx), step_pairs=N_PAIRS).backward()
    torch.testing.assert_close(model.weight.grad, full_step_gradient(), rtol=1e-6, atol=1e-7)


def test_a_mean_of_micro_batch_means_would_not():
    model = make_model()
    for idx in SPLITS:  # what trainers that average per micro-batch do
        (losses_for(model, idx).mean() / len(SPLITS)).backward()
    assert not torch.allclose(model.weight.grad, full_step_gradient(), rtol=1e-3)


def test_an_empty_micro_batch_contributes_nothing():
    model = make_model()
    loss = microbatch_loss(losses_for(model, []), step_pairs=N_PAIRS)
    assert loss.item() == 0.0


def _global_count(local: int) -> float:
    """Sum a count over all ranks: how a trainer learns the step's pair count when its loader does not say."""
    import torch.distributed as dist

    value = torch.tensor([float(local)], dtype=torch.float64)
    dist.all_reduce(value)
    return float(value.item())


def _rank_main(rank, world_size, port, rank_splits, out):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    join_gloo(rank, world_size, port)
    model = DDP(make_model())
    splits = rank_splits[rank]
    step_pairs = _global_count(sum(len(s) for s in splits))  # 6: all pairs of the step, over ranks
    passes = max(len(s) for s in rank_splits)  # every rank runs the same number of passes
    for k in range(passes):
        idx = splits[k] if k < len(splits) else []  # a short rank runs an empty micro-batch
        sync = contextlib.nullcontext() if k == passes - 1 else model.no_sync()  # sync once, at the end
        with sync:
            microbatch_loss(losses_for(model, idx), step_pairs).backward()
    out[rank] = model.module.weight.grad.clone()
    dist.destroy_process_group()


@pytest.mark.slow
def test_ddp_on_gloo_with_uneven_ranks_gives_the_step_mean_gradient():
    # Rank 0 holds 5 pairs in 2 micro-batches, rank 1 one pair in one: the ranks are uneven on purpose.
    rank_splits = [[[0, 1, 2], [3, 4]], [[5]]]
    manager = mp.Manager()
    out = manager.dict()
    spawn(_rank_main, 2, rank_splits, out)
    expected = full_step_gradient()
    for rank in range(2):
        torch.testing.assert_close(out[rank], expected, rtol=1e-6, atol=1e-7)
