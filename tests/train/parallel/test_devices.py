"""Device-correct paths without an accelerator: every collective on its backend's device, RNG per device kind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dpo_train.parallel import collectives
from tests.harness import join_gloo, spawn, tiny_trainer
from tests.train.test_trainer import write_config

GUARD = Path(__file__).parents[2] / "collective_guard.py"


_HCCL = """
import types, torch
from dpo_train.parallel import collectives
torch.utils.rename_privateuse1_backend("npu")  # what importing torch_npu does first
torch.npu = types.SimpleNamespace(current_device=lambda: 5)
assert collectives.device_for("hccl") == torch.device("npu", 5), collectives.device_for("hccl")
"""


def test_each_backend_reduces_on_its_own_device(monkeypatch):
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert collectives.device_for("gloo") == torch.device("cpu")
    assert collectives.device_for("cpu:gloo,cuda:nccl") == torch.device("cpu")
    assert collectives.device_for("nccl") == torch.device("cuda", 3)
    with pytest.raises(ValueError, match="'mpi'"):
        collectives.device_for("mpi")
    # hccl in a process of its own: naming torch's out-of-tree device "npu" cannot be undone, and later
    # tests in this process would then look for a torch.npu module
    proc = subprocess.run([sys.executable, "-c", _HCCL], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_all_reduce_moves_to_the_backend_device_and_back(monkeypatch):
    """Under nccl a CPU tensor must travel to the GPU and back: simulated with the meta device."""
    received = []

    def fake_all_reduce(tensor, op, group=None):
        received.append((tensor.device, op))

    monkeypatch.setattr(collectives, "active", lambda: True)
    monkeypatch.setattr(collectives, "device", lambda: torch.device("meta"))
    monkeypatch.setattr(collectives.dist, "all_reduce", fake_all_reduce)
    monkeypatch.setattr(torch.Tensor, "to", _to_meta_and_back, raising=True)
    out = collectives.all_reduce(torch.ones(3), "max")
    assert received == [(torch.device("meta"), collectives.dist.ReduceOp.MAX)]
    assert out.device == torch.device("cpu")


_real_to = torch.Tensor.to


def _to_meta_and_back(self, where, *args, **kwargs):
    """meta -> cpu cannot copy data (there is none): give zeros of the shape, enough to see the round trip."""
    if self.device.type == "meta" and torch.device(where).type == "cpu":
        return torch.zeros(self.shape, dtype=self.dtype)
    return _real_to(self, where, *args, **kwargs)


def test_no_module_calls_a_collective_directly():
    """The static half of the guard below: only dpo_train/parallel/collectives.py names dist.<collective>."""
    root = Path(__file__).parents[3]
    offenders = []
    for package in ("dpo_train", "dpo_data", "dpo_state", "cli"):
        for path in (root / package).rglob("*.py"):
            if path.name == "collectives.py":
                continue
            text = path.read_text()
            for name in ("all_reduce(", "all_gather", "broadcast", "barrier(", "reduce_scatter", "all_to_all"):
                if f"dist.{name}" in text:
                    offenders.append(f"{path.relative_to(root)}: dist.{name}")
    assert offenders == []


def _guarded(config, tmp_path, *extra, code=0, env=None):
    args = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        str(GUARD),
        str(config),
        "--quiet",
        *extra,
    ]
    guard_out = tmp_path / f"guard-{len(list(tmp_path.glob('guard-*')))}"
    env = {**(env or os.environ), "COLLECTIVE_GUARD_OUT": str(guard_out)}
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == code, proc.stderr[-4000:]
    return proc, [json.loads(p.read_text()) for p in sorted(guard_out.glob("rank-*.json"))]


@pytest.mark.slow
def test_every_collective_goes_through_the_helper_on_its_device(small_dataset, smollm2_dir, tmp_path):
    """Precompute, train with eval and checkpoints, then resume into a failing save, on 2 gloo ranks with every
    torch.distributed collective wrapped (tests/collective_guard.py): a direct call or a tensor on another
    device than the helper's fails the rank. On the 24-pair dataset: which collectives run, and where, does
    not depend on how many pairs are scored (the sample's 342 made scoring most of the test). The resume and the
    failing save share one launch (rank 1's save of step 3, the resumed run's first): each launch of 2 ranks
    costs about ten seconds, and the first run's end already exports."""
    out = tmp_path / "run"
    config = write_config(tmp_path, small_dataset, smollm2_dir, out)
    sidecar = ["--set", "reference.mode=precomputed", "--set", f"reference.path={tmp_path / 'sidecar'}"]
    _, precompute = _guarded(config, tmp_path, "--precompute-reference", *sidecar)
    _, first = _guarded(config, tmp_path, "--set", "train.max_steps=2", "--set", "train.save_every=1", *sidecar)
    fault = {**os.environ, "DPO_TRAIN_SAVE_FAULT": "1:3"}
    failed, resumed = _guarded(config, tmp_path, "--set", "train.save_every=1", *sidecar, code=1, env=fault)
    assert "injected save fault" in failed.stderr and "resumed from" in failed.stderr
    for calls in (precompute, first, resumed):
        assert len(calls) == 2  # both ranks ran to their end
    sites = {site for run in (precompute, first, resumed) for calls in run for site in calls}
    expected = {
        "all_reduce<-collectives.gather_failures",  # check_data, save, the export's vote
        "all_reduce<-collectives.spread",  # nonfinite.agree (non-finite vote, step_pairs), the step to save
        "all_reduce<-trainer.step",  # the step's metric sums
        "all_reduce<-scoring.score_pairs",  # precompute and eval tables
        "all_gather_object<-save.save",  # the ranks' loader positions
        "all_gather_object<-collectives.gather_failures",  # the failure messages, when a rank failed
        "broadcast_object_list<-restore.find_resume",
        "barrier<-save.save",
        "barrier<-restore.abandon_later",
        "barrier<-precompute.precompute_reference",
    }
    assert expected <= sites, expected - sites
    assert any(site.startswith("torch:") for calls in first for site in calls)  # FSDP2 and DCP are not ours to place


class _FakeNpu:
    """torch.npu as torch-npu provides it, reduced to its default generator."""

    def __init__(self):
        self.state = torch.tensor([7, 7, 7], dtype=torch.uint8)

    def get_rng_state(self):
        return self.state.clone()

    def set_rng_state(self, state):
        self.state = state.clone()


def test_rng_states_are_saved_and_restored_per_device_kind(monkeypatch):
    from dpo_train.checkpoint.parts import RNGState

    npu = _FakeNpu()
    monkeypatch.setattr(torch, "npu", npu, raising=False)
    saved = RNGState("npu").state_dict()
    assert sorted(saved) == ["cpu", "npu"] and saved["npu"].tolist() == [7, 7, 7]
    expected = torch.rand(4)  # the draw the saved cpu state produces
    npu.state = torch.tensor([1, 2, 3], dtype=torch.uint8)
    RNGState("npu").load_state_dict(saved)
    assert npu.state.tolist() == [7, 7, 7] and torch.equal(torch.rand(4), expected)
    assert sorted(RNGState("cpu").state_dict()) == ["cpu"]


def test_rng_states_of_another_device_kind_are_refused():
    from dpo_train.checkpoint.parts import RNGState
    from dpo_train.errors import ResumeError

    with pytest.raises(ResumeError, match="generator states for cpu, cuda, this run needs cpu"):
        RNGState("cpu").load_state_dict({"cpu": torch.get_rng_state(), "cuda": torch.zeros(8, dtype=torch.uint8)})


def test_the_identity_knows_the_device_kind():
    from dpo_state.state import identity_mismatches

    saved = {"layout": {"batching": "pairs", "device": "cuda", "world_size": 8}}
    now = {"layout": {"batching": "pairs", "device": "npu", "world_size": 4}}
    mismatches, elastic = identity_mismatches(saved, now)
    assert mismatches == ["layout.device: checkpoint cuda, this run npu"]
    assert elastic == ["layout.world_size: checkpoint 8, this run 4"]


def _reference_worker(rank: int, world: int, port: int, dataset: str, out: str) -> None:
    """One of 2 FSDP2 ranks: build the Trainer with a live reference and describe both models' parameters."""
    import torch.distributed as dist

    from tests.train.test_invariance import MODEL

    join_gloo(rank, world, port)
    config = {
        "model": {"init": {"config": MODEL, "seed": 0}},
        "data": {"path": dataset, "batching": "pairs", "pairs_per_step": 4, "max_tokens_per_microbatch": 400},
        "distributed": {"strategy": "fsdp", "device": "cpu"},
    }
    trainer = tiny_trainer(config, rank=rank, world=2)

    def describe(model):
        params = list(model.parameters())
        local = sum(p.to_local().numel() if hasattr(p, "to_local") else p.numel() for p in params)
        return {
            "local": local,
            "total": sum(p.numel() for p in params),
            "sharded": all(hasattr(p, "to_local") for p in params),
            "trainable": sum(p.requires_grad for p in params),
        }

    in_optimizer = {id(p) for group in trainer.optimizer.param_groups for p in group["params"]}
    policy_params = dict(trainer.policy.named_parameters())
    same_weights = all(
        torch.equal(p.full_tensor(), policy_params[name].full_tensor())
        for name, p in trainer.reference.initial.named_parameters()
    )
    policy_buffers = dict(trainer.policy.named_buffers())
    same_buffers = all(torch.equal(b, policy_buffers[n]) for n, b in trainer.reference.initial.named_buffers())
    report = {
        "same_weights": same_weights and len(policy_params) == len(list(trainer.reference.initial.parameters())),
        "same_buffers": same_buffers and bool(policy_buffers),
        "policy": describe(trainer.policy),
        "reference": describe(trainer.reference.initial),
        "reference_in_optimizer": any(id(p) in in_optimizer for p in trainer.reference.initial.parameters()),
    }
    Path(out, f"rank-{rank}.json").write_text(json.dumps(report))
    dist.destroy_process_group()


@pytest.mark.slow
def test_the_live_reference_is_sharded_like_the_policy_under_fsdp2(sample_dataset, tmp_path):
    spawn(_reference_worker, 2, str(sample_dataset), str(tmp_path))
    for rank in (0, 1):
        report = json.loads((tmp_path / f"rank-{rank}.json").read_text())
        policy, reference = report["policy"], report["reference"]
        assert reference["sharded"] and reference["total"] == policy["total"]
        assert reference["local"] == policy["local"] <= reference["total"] // 2 + 64  # half, up to uneven rows
        assert reference["trainable"] == 0 and not report["reference_in_optimizer"]
        assert report["same_weights"] and report["same_buffers"]  # the initial policy's, shard for shard
