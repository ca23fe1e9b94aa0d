"""TR-DPO (`reference.sync_ref_model`): the live reference moves by TRL's mixup rule every k steps, the loss
reads the moved reference, resume is bitwise exact (the reference is checkpoint state), and 2-rank FSDP2 and
DDP gloo runs move it as 1 rank does."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import shutil

import pytest
import torch

from dpo_data.loading.microbatch import is_last
from tests.harness import (
    TINY_LLAMA,
    free_port,
    invoke,
    join_gloo,
    spawn,
    state_here,
    tiny_config,
    tiny_trainer,
    train_here,
    write_yaml,
)

RTOL = 2e-6  # ||a - b|| / ||a|| per tensor across world sizes, fp32 on CPU (as tests/train/test_invariance.py)
TIMING = ("pairs/s", "tokens/s", "time")


def _config(dataset, strategy: str = "ddp", **reference) -> dict:
    """The trainer's config in code: TINY_LLAMA, 4 pairs a step, plain SGD at lr 1 (parameters follow the
    gradient linearly, so world sizes agree to fp32 rounding), and `reference` keys."""
    return {
        "model": {"init": {"config": TINY_LLAMA, "seed": 0}},
        "reference": reference,
        "data": {"path": str(dataset), "batching": "pairs", "pairs_per_step": 4, "max_tokens_per_microbatch": 256},
        "optim": {"name": "sgd", "lr": 1.0},
        "train": {"output_dir": "unused", "max_steps": 4},
        "distributed": {"strategy": strategy, "device": "cpu"},
    }


def _loader(trainer):
    """The real loader's batches for the trainer's rank."""
    from dpo_data.loading.loader import DPOLoader

    cfg = trainer.config
    return DPOLoader([cfg.data.path], cfg.data.loader_config(trainer.rank, trainer.world), pad_to_multiple_of=8)


def _step(trainer, batches) -> dict:
    """One optimizer step: the step's micro-batches, then `Trainer.step` (its record)."""
    while True:
        batch = next(batches)
        trainer.microbatch(batch)
        if is_last(batch):
            return trainer.step()


def _weights(model) -> dict:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _bitwise(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- the mixup rule, against TRL ---------------------------------------------------------------------------------


def test_the_reference_moves_by_trls_mixup_rule_after_every_kth_step_only(small_dataset):
    """After optimizer steps 2 and 4 (k = 2, alpha 0.3) the reference is what TRL 1.16's own
    `SyncRefModelCallback._sync_target_model` makes of a copy of the reference before the step and the
    policy after it, bitwise; after steps 1 and 3 it is untouched, bitwise."""
    from trl.trainer.callbacks import SyncRefModelCallback

    trainer = tiny_trainer(
        _config(small_dataset, sync_ref_model=True, ref_model_mixup_alpha=0.3, ref_model_sync_steps=2)
    )
    loader = _loader(trainer)
    batches, reference = iter(loader), trainer.reference.initial
    for step in range(1, 5):
        before = copy.deepcopy(reference)
        _step(trainer, batches)
        if step % 2:
            assert _bitwise(_weights(reference), _weights(before)), f"step {step} moved the reference"
            continue
        assert not _bitwise(_weights(reference), _weights(before)), f"step {step} did not move the reference"
        SyncRefModelCallback._sync_target_model(trainer.policy, before, 0.3)
        assert _bitwise(_weights(reference), _weights(before)), f"step {step}: not TRL's mixup"


def test_a_skipped_step_still_counts_toward_the_move(small_dataset, monkeypatch):
    """train.on_nonfinite skip_step: step 2 (k = 2) reported non-finite is skipped, the policy stays as step 1
    left it, and the reference still moves on schedule, toward that policy (TRL's rule)."""
    from trl.trainer.callbacks import SyncRefModelCallback

    import dpo_train.trainer

    config = _config(small_dataset, sync_ref_model=True, ref_model_mixup_alpha=0.3, ref_model_sync_steps=2)
    config["train"]["on_nonfinite"] = "skip_step"
    trainer = tiny_trainer(config)
    loader = _loader(trainer)
    batches, reference = iter(loader), trainer.reference.initial
    _step(trainer, batches)
    policy, before = _weights(trainer.policy), copy.deepcopy(reference)
    exact = dpo_train.trainer.local_nonfinite
    monkeypatch.setattr(dpo_train.trainer, "local_nonfinite", lambda *args: ["loss"])
    assert _step(trainer, batches)["skipped"] is True
    monkeypatch.setattr(dpo_train.trainer, "local_nonfinite", exact)
    assert _bitwise(_weights(trainer.policy), policy)
    SyncRefModelCallback._sync_target_model(trainer.policy, before, 0.3)
    assert _bitwise(_weights(reference), _weights(before))


def _records(out, name: str = "metrics.jsonl") -> list[dict]:
    """A run's metrics.jsonl (or eval.jsonl) records, timing aside."""
    return [
        {k: v for k, v in json.loads(line).items() if k not in TIMING} for line in (out / name).read_text().splitlines()
    ]


def _losses(run_cli, dataset, tokenizer, out, **reference) -> list[dict]:
    config = tiny_config(dataset, tokenizer, out, max_steps=4)
    config["reference"] = reference
    train_here(run_cli, write_yaml(out.parent / f"{out.name}.yaml", config))
    return _records(out)


def test_the_loss_after_a_move_compares_against_the_moved_reference(small_dataset, smollm2_dir, tmp_path, run_cli):
    """With alpha 1 a move makes the reference the policy, so every pair's margin at the next step is exactly
    0 and the loss exactly log 2, as at the first step (policy = reference); the same run without the move has
    margins there, so the loss really reads the moved reference."""
    moved = _losses(
        run_cli,
        small_dataset,
        smollm2_dir,
        tmp_path / "moved",
        sync_ref_model=True,
        ref_model_mixup_alpha=1.0,
        ref_model_sync_steps=2,
    )
    fixed = _losses(run_cli, small_dataset, smollm2_dir, tmp_path / "fixed")
    tie = moved[0]["loss"]
    assert tie == pytest.approx(0.693147, abs=1e-6) and moved[0]["rewards/margins"] == 0.0
    # records 0..3 are steps 1..4; the reference moved after step 2, so record 2 (step 3) ties
    assert [r["rewards/margins"] == 0.0 for r in moved] == [True, False, True, False]
    assert moved[2]["loss"] == tie and moved[1]["loss"] != tie and moved[3]["loss"] != tie
    assert moved[:2] == fixed[:2]  # before the move the two runs are the same run
    assert fixed[2]["rewards/margins"] != 0.0 and fixed[2]["loss"] != tie


def test_the_cli_refuses_tr_dpo_with_a_precomputed_reference_before_anything_starts(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    config = tiny_config(small_dataset, smollm2_dir, tmp_path / "out")
    config["reference"] = {"mode": "precomputed", "path": str(tmp_path / "sidecar"), "sync_ref_model": True}
    (tmp_path / "sidecar").mkdir()  # there, so that the rule is what refuses (a missing one is named first)
    result = train_here(run_cli, write_yaml(tmp_path / "c.yaml", config), code=2)
    assert result.stderr.startswith("error: reference.sync_ref_model is true, but reference.mode is precomputed: ")
    assert "Traceback" not in result.stderr and not (tmp_path / "out").exists()


# -- resume -------------------------------------------------------------------------------------------------------


def _run_config(tmp_path, dataset, tokenizer, name: str, max_steps: int, **reference):
    """A run that moves its reference after every second step, saves every step and evaluates every step
    (on its own training data: the baseline, scored before step 1, is the initial policy)."""
    out = tmp_path / name
    config = tiny_config(dataset, tokenizer, out, max_steps=max_steps, save_every=1, keep_last=2)
    config["reference"] = {
        "sync_ref_model": True,
        "ref_model_mixup_alpha": 0.5,
        "ref_model_sync_steps": 2,
        **reference,
    }
    config["eval"] = {"path": str(dataset), "every": 1}
    return write_yaml(tmp_path / f"{name}.yaml", config), out


@pytest.fixture(scope="module")
def resumed(small_dataset, smollm2_dir, tmp_path_factory):
    """An uninterrupted 5-step run, and the same run stopped after step 3 (one step after the move at step 2)
    and resumed to step 5; a copy of the stopped run is kept for the broken variant."""
    run_cli = invoke  # the run_cli fixture's, for a module fixture
    tmp = tmp_path_factory.mktemp("trdpo")
    full, full_out = _run_config(tmp, small_dataset, smollm2_dir, "full", 5)
    train_here(run_cli, full)
    cut, cut_out = _run_config(tmp, small_dataset, smollm2_dir, "cut", 3)
    train_here(run_cli, cut)
    shutil.copytree(cut_out, tmp / "broken")
    again, _ = _run_config(tmp, small_dataset, smollm2_dir, "cut", 5)
    assert f"resumed from {cut_out / 'checkpoints' / 'step-000003'}" in train_here(run_cli, again).stderr
    return {"full": full_out, "cut": cut_out, "tmp": tmp}


@pytest.mark.slow
def test_a_run_resumed_after_a_move_is_bitwise_the_uninterrupted_one(resumed, run_cli):
    """Policy, optimizer and reference tensors of step 5 bitwise equal (`dpo-state diff --values`), every step's
    metrics and every evaluation equal; the checkpoint lists the reference's tensors."""
    from dpo_state.audit import diff_checkpoints

    full, cut = resumed["full"], resumed["cut"]
    assert _records(cut, "metrics.jsonl") == _records(full, "metrics.jsonl")
    assert _records(cut, "eval.jsonl") == _records(full, "eval.jsonl")
    step5 = "checkpoints/step-000005"
    diff = diff_checkpoints(full / step5, cut / step5, values=True)
    assert diff["equal"], diff
    names = [row["tensor"] for row in diff["tensors"]["per_tensor"]]
    assert sum(n.startswith("reference.") for n in names) == sum(n.startswith("model.") for n in names) > 0
    inspected = json.loads(state_here(run_cli, "inspect", cut, "--json").stdout)
    assert inspected["tensors"]["reference"] == inspected["tensors"]["model"]
    assert inspected["identity"]["reference"]["ref_model_sync_steps"] == 2
    count = inspected["tensors"]["reference"]["count"]
    assert f"tensors     reference: {count} tensors" in state_here(run_cli, "inspect", cut).stdout


@pytest.mark.slow
def test_without_the_reference_in_the_checkpoint_the_resumed_run_differs(
    resumed, small_dataset, smollm2_dir, monkeypatch, run_cli
):
    """The broken variant: a resume that leaves the reference part out of the checkpointed state restarts from
    the initial reference, and every step after the resume differs from the uninterrupted run."""
    import dpo_train.trainer

    exact = dpo_train.trainer.Trainer.checkpointable
    monkeypatch.setattr(
        dpo_train.trainer.Trainer,
        "checkpointable",
        lambda self, loader: dataclasses.replace(exact(self, loader), reference=None),
    )
    config, out = _run_config(resumed["tmp"], small_dataset, smollm2_dir, "broken", 5)
    train_here(run_cli, config)
    broken, full = _records(out, "metrics.jsonl"), _records(resumed["full"], "metrics.jsonl")
    assert broken[:3] == full[:3]
    assert [b["loss"] != f["loss"] for b, f in zip(broken[3:], full[3:])] == [True, True]


@pytest.mark.slow
def test_a_resume_with_other_tr_dpo_settings_is_refused_naming_them(resumed, small_dataset, smollm2_dir, run_cli):
    tmp = resumed["tmp"]
    config, _ = _run_config(tmp, small_dataset, smollm2_dir, "cut", 6, ref_model_mixup_alpha=0.25)
    stderr = train_here(run_cli, config, code=2).stderr
    assert "was made by a different run" in stderr
    assert "reference.ref_model_mixup_alpha: checkpoint 0.5, this run 0.25" in stderr
    off = write_yaml(tmp / "off.yaml", tiny_config(small_dataset, smollm2_dir, resumed["cut"], max_steps=6))
    stderr = train_here(run_cli, off, code=2).stderr
    assert "reference.sync_ref_model: checkpoint true, this run <absent>" in stderr


# -- ranks ----------------------------------------------------------------------------------------------------------


def _worker(rank: int, world: int, port: int, jobs: list) -> None:
    """One rank running each (config, result, out) job: 3 steps, every one followed by a move (k = 1); rank 0
    saves the policy's and the reference's whole weights. With `out` it then saves a checkpoint there with the
    real checkpointer, restores it into a fresh trainer and checks that trainer's reference (shards) bitwise."""
    import torch.distributed as dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    if world > 1:
        join_gloo(rank, world, port)
    for config, result, out in jobs:
        trainer = tiny_trainer(config, rank=rank, world=world)
        loader = _loader(trainer)
        batches = iter(loader)
        for _ in range(3):
            _step(trainer, batches)
        whole = {f"policy/{k}": v for k, v in _full(trainer.policy).items()}
        whole.update({f"reference/{k}": v for k, v in _full(trainer.reference.initial).items()})
        if rank == 0:
            torch.save(whole, result)
        if out:
            _check_restore(trainer, loader, out, config, rank, world)
        if world > 1:
            dist.barrier()
    if world > 1:
        dist.destroy_process_group()


def _full(model) -> dict:
    """The whole weights (FSDP shards gathered: every rank must call), on CPU."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return {k: v.clone() for k, v in state.items()}


def _check_restore(trainer, loader, out, config, rank: int, world: int) -> None:
    """Save after step 3 through `checkpoint.save.save`, restore into a fresh trainer: its reference's local
    shards are the trained ones, bitwise, and differ from the initial reference's."""
    import dataclasses
    from pathlib import Path

    from dpo_train.checkpoint.parts import new_lineage
    from dpo_train.checkpoint.restore import restore
    from dpo_train.checkpoint.save import save

    run = dataclasses.replace(trainer.run, out=Path(out))
    path = save(trainer.checkpointable(loader), run, trainer.identity(), new_lineage())
    fresh = tiny_trainer(config, rank=rank, world=world)
    fresh_loader = _loader(fresh)
    before = _local(fresh.reference.initial)
    restore(fresh.checkpointable(fresh_loader), dataclasses.replace(fresh.run, out=Path(out)), fresh.identity(), path)
    trained, restored = _local(trainer.reference.initial), _local(fresh.reference.initial)
    assert _bitwise(restored, trained) and not _bitwise(before, trained), f"rank {rank}"


def _local(model) -> dict:
    return {k: (p.to_local() if hasattr(p, "to_local") else p).detach().clone() for k, p in model.named_parameters()}


def _worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys() and any(k.startswith("reference/") for k in a)
    return max(float((a[k] - b[k]).double().norm() / a[k].double().norm().clamp(min=1e-30)) for k in a)


@pytest.mark.slow
def test_two_ranks_move_the_reference_as_one_does(small_dataset, tmp_path):
    """FSDP2 (each rank mixing its own shards) and DDP over 2 gloo ranks end 3 moving steps with 1 rank's
    policy and reference within fp32 rounding; each one's checkpoint restores its reference (FSDP2: each rank's
    shards) bitwise."""
    sync = {"sync_ref_model": True, "ref_model_mixup_alpha": 0.5, "ref_model_sync_steps": 1}
    results = {name: str(tmp_path / f"{name}.pt") for name in ("one", "fsdp", "ddp")}
    saved = dict(os.environ)
    try:
        _worker(0, 1, free_port(), [(_config(small_dataset, **sync), results["one"], None)])
    finally:  # world 1 runs here: keep the rank variables it sets out of later tests
        os.environ.clear()
        os.environ.update(saved)
    jobs = [
        (_config(small_dataset, "fsdp", **sync), results["fsdp"], str(tmp_path / "fsdp-run")),
        (_config(small_dataset, "ddp", **sync), results["ddp"], str(tmp_path / "ddp-run")),
    ]
    spawn(_worker, 2, jobs)
    one, fsdp, ddp = (torch.load(results[name], weights_only=True) for name in ("one", "fsdp", "ddp"))
    assert _worst(one, fsdp) < RTOL and _worst(one, ddp) < RTOL
