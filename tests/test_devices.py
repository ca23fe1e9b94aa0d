"""Device-correct paths without an accelerator: every collective on its backend's device, RNG per device kind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from dpo_train import collectives
from tests.test_trainer import write_config

GUARD = Path(__file__).with_name("collective_guard.py")


def _register_npu() -> None:
    """What importing torch_npu does first: name torch's out-of-tree device slot "npu"."""
    if torch._C._get_privateuse1_backend_name() != "npu":
        torch.utils.rename_privateuse1_backend("npu")


def test_each_backend_reduces_on_its_own_device(monkeypatch):
    _register_npu()
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(current_device=lambda: 5), raising=False)
    assert collectives.device_for("gloo") == torch.device("cpu")
    assert collectives.device_for("cpu:gloo,cuda:nccl") == torch.device("cpu")
    assert collectives.device_for("nccl") == torch.device("cuda", 3)
    assert collectives.device_for("hccl") == torch.device("npu", 5)
    with pytest.raises(ValueError, match="'mpi'"):
        collectives.device_for("mpi")


def test_all_reduce_moves_to_the_backend_device_and_back(monkeypatch):
    """Under nccl a CPU tensor must travel to the GPU and back: simulated with the meta device."""
    received = []

    def fake_all_reduce(tensor, op):
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
    """The static half of the guard below: only dpo_train/collectives.py names dist.<collective>."""
    root = Path(__file__).parents[1]
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
def test_every_collective_goes_through_the_helper_on_its_device(sample_dataset, smollm2_dir, tmp_path):
    """Precompute, train with eval and checkpoints, resume, and a failing save, on 2 gloo ranks with every
    torch.distributed collective wrapped (tests/collective_guard.py): a direct call or a tensor on another
    device than the helper's fails the rank."""
    out = tmp_path / "run"
    config = write_config(tmp_path, sample_dataset, smollm2_dir, out)
    sidecar = ["--set", "reference.mode=precomputed", "--set", f"reference.path={tmp_path / 'sidecar'}"]
    _, precompute = _guarded(config, tmp_path, "--precompute-reference", *sidecar)
    _, first = _guarded(config, tmp_path, "--set", "train.max_steps=2", "--set", "train.save_every=1", *sidecar)
    _, resumed = _guarded(config, tmp_path, "--set", "train.save_every=1", *sidecar)
    fault = {**os.environ, "DPO_TRAIN_SAVE_FAULT": "1:1"}
    failed, failing = _guarded(
        config,
        tmp_path,
        "--set",
        f"train.output_dir={tmp_path / 'f'}",
        "--set",
        "train.save_every=1",
        code=1,
        env=fault,
    )
    assert "injected save fault" in failed.stderr and len(failing) == 2
    for calls in (precompute, first, resumed, failing):
        assert len(calls) == 2  # both ranks ran to their end
    sites = {site for run in (precompute, first, resumed, failing) for calls in run for site in calls}
    expected = {
        "all_reduce<-collectives.gather_failures",  # check_data, save
        "all_reduce<-guard.agree",  # the non-finite vote and step_pairs agreement
        "all_reduce<-trainer.step",  # the step's metric sums
        "all_reduce<-checkpointing._agree",  # the step to save
        "all_reduce<-scoring.score_pairs",  # precompute and eval tables
        "all_gather_object<-checkpointing.save",  # the ranks' loader positions
        "all_gather_object<-collectives.gather_failures",  # the failure messages, when a rank failed
        "broadcast_object_list<-checkpointing.find_resume",
        "barrier<-checkpointing.save",
        "barrier<-checkpointing.abandon_later",
        "barrier<-precompute.precompute_reference",
        "barrier<-trainer._export",
    }
    assert expected <= sites, expected - sites
    assert any(site.startswith("torch:") for calls in first for site in calls)  # FSDP2 and DCP are not ours to place
