"""The first step's gradient norm checked against torch's clip_grad_norm_: summed apart over every rank's shards
(FSDP2, uneven ones too), and a run whose clip_grad_norm_ leaves a parameter out refused before it steps."""

from __future__ import annotations

import math

import pytest
import torch

from dpo_train.step.grad_norm import gradient_norm, norm_mismatch
from tests.harness import TINY_LLAMA, join_gloo, spawn, tiny_config, tiny_trainer, train_here, write_yaml


def _sharded_norms(rank: int, world: int, port: int) -> None:
    import torch.distributed as dist
    from torch.distributed.fsdp import fully_shard

    join_gloo(rank, world, port)
    torch.manual_seed(0)
    # 33 and 5 rows split unevenly over 2 ranks; the frozen layer has no gradient, as clip_grad_norm_ skips it
    model = torch.nn.Sequential(torch.nn.Linear(7, 33), torch.nn.Linear(33, 5), torch.nn.Linear(5, 3))
    model[2].requires_grad_(False)
    fully_shard(model[0])
    fully_shard(model)
    model(torch.randn(4, 7, generator=torch.Generator().manual_seed(rank))).square().sum().backward()
    whole = math.sqrt(
        sum(float(p.grad.full_tensor().double().square().sum()) for p in model.parameters() if p.grad is not None)
    )
    ours = gradient_norm(model.parameters())
    theirs = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
    assert ours == pytest.approx(whole, rel=1e-6) and theirs == pytest.approx(whole, rel=1e-5)
    assert norm_mismatch(theirs, ours, {torch.float32}) is None
    dist.destroy_process_group()


def test_the_norm_of_sharded_gradients_is_the_whole_gradients():
    spawn(_sharded_norms, 2)


def test_a_plain_gradient_counts_once():
    layer = torch.nn.Linear(3, 2)
    layer(torch.ones(1, 3)).sum().backward()
    expected = math.sqrt(float(layer.weight.grad.square().sum() + layer.bias.grad.square().sum()))
    assert gradient_norm(layer.parameters()) == pytest.approx(expected, rel=1e-7)


@pytest.mark.parametrize(
    ("reported", "independent", "dtypes", "refused"),
    [
        (1.0, 1.0 + 5e-5, {torch.float32}, False),
        (0.755, 1.081, {torch.float32}, True),  # torch 2.9.1 under FSDP2: the embedding left out
        (1.0, 1.0 + 5e-4, {torch.float32}, True),
        (1.0, 1.01, {torch.bfloat16, torch.float32}, False),  # bf16 gradients: rounded squares
        (1.0, 1.05, {torch.bfloat16}, True),
        (float("inf"), 3.0, {torch.float32}, False),  # non-finite: the non-finite check's to stop
        (0.0, 0.0, set(), False),
    ],
)
def test_the_tolerance(reported, independent, dtypes, refused):
    assert (norm_mismatch(reported, independent, dtypes) is not None) == refused


def _without_the_embedding(clip):
    """clip_grad_norm_ as torch 2.9.1 computed it under FSDP2: the embedding's gradient left out of the norm."""

    def clip_grad_norm_(parameters, max_norm, *args, **kwargs):
        kept = [p for p in parameters if p.dim() != 2 or p.shape[0] != 49152]
        return clip(kept, max_norm, *args, **kwargs)

    return clip_grad_norm_


def test_a_wrong_clip_norm_is_refused_before_the_first_step(small_dataset, smollm2_dir, tmp_path, run_cli, monkeypatch):
    monkeypatch.setattr(torch.nn.utils, "clip_grad_norm_", _without_the_embedding(torch.nn.utils.clip_grad_norm_))
    out = tmp_path / "run"
    config = write_yaml(tmp_path / "c.yaml", tiny_config(small_dataset, smollm2_dir, out, max_steps=2))
    refused = train_here(run_cli, config, code=2)
    assert "step 1 (this process's first): torch.nn.utils.clip_grad_norm_ returned a gradient norm of" in refused.stderr
    assert "Nothing was stepped" in refused.stderr and "train.parity_guard: false" in refused.stderr
    assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text()
    unguarded = train_here(run_cli, config, "--set", "train.parity_guard=false", "--set", "train.resume=never")
    assert unguarded.exit_code == 0 and len((out / "metrics.jsonl").read_text().splitlines()) == 2


def _one_rank_wrong(rank: int, world: int, port: int, dataset: str) -> None:
    """Two FSDP2 ranks, rank 1's clip_grad_norm_ wrong: both refuse, rank 0 naming the other rank."""
    import torch.distributed as dist

    from dpo_data.dataset.store import PairStore
    from dpo_data.loading.microbatch import pack_microbatch
    from dpo_train.errors import GradNormError

    join_gloo(rank, world, port)
    config = {
        "model": {"init": {"config": TINY_LLAMA, "seed": 0}},
        "data": {"path": dataset},
        "train": {"output_dir": "unused"},
        "distributed": {"device": "cpu", "strategy": "fsdp"},
    }
    trainer = tiny_trainer(config, rank=rank, world=world, store=PairStore([dataset]))
    if rank == 1:  # the same collectives as rank 0's (a mismatch would fail gloo itself), another norm returned
        clip = torch.nn.utils.clip_grad_norm_
        torch.nn.utils.clip_grad_norm_ = lambda *args, **kwargs: clip(*args, **kwargs) * 0.96
    store = PairStore([dataset])
    pairs = [store.pair(i) for i in (2 * rank, 2 * rank + 1)]
    batch = pack_microbatch(pairs, pad_to_multiple_of=8)
    chosen = sum(len(store.pair(i).chosen) for i in range(4))
    batch.update(microbatch=0, microbatches_in_step=1, step_pairs=4, step_chosen_tokens=chosen)
    trainer.microbatch(batch)
    with pytest.raises(GradNormError) as refused:
        trainer.step()
    expected = "another rank found torch.nn.utils.clip_grad_norm_ wrong" if rank == 0 else "returned a gradient norm of"
    assert expected in str(refused.value), str(refused.value)
    dist.destroy_process_group()


def test_every_rank_stops_when_one_ranks_norm_is_wrong(small_dataset):
    spawn(_one_rank_wrong, 2, str(small_dataset))
