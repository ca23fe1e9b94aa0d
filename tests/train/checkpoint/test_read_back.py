"""A process's first save is read back before it is committed: a checkpoint that does not hold what the run held
stops the run with nothing committed, where before it committed, verified and resumed into other numbers."""

from __future__ import annotations

import re

import pytest
import torch

from tests.harness import state_here, tiny_config, train_cli, train_here, write_yaml

FLIP = "DPO_TRAIN_SAVE_FAULT"
"""flip:RANK:STEP flips one bit in that rank's largest DCP file once DCP has written it (dpo_state/faults.py)."""


def _config(tmp_path, dataset, tokenizer, name, **train):
    out = tmp_path / name
    path = write_yaml(
        tmp_path / f"{name}.yaml", tiny_config(dataset, tokenizer, out, **{"max_steps": 2, "save_every": 1, **train})
    )
    return path, out


def _committed(out) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step-"))


def _refused(stderr: str, rank: int = 0) -> None:
    assert (
        "saving step 1 failed, nothing was committed (the previous checkpoint stays the latest): the checkpoint "
        in stderr
    )
    assert f"does not read back what was saved; rank {rank}: " in stderr, stderr[-3000:]
    assert "train.read_back: false skips this check" in stderr and "Traceback" not in stderr


def test_a_first_save_that_does_not_read_back_is_not_committed(
    small_dataset, smollm2_dir, tmp_path, run_cli, monkeypatch
):
    """One bit of one tensor changed on its way to the disk: exit 1 at the first save, naming the tensor, how many
    of its values differ and the first of them; no checkpoint and no export."""
    path, out = _config(tmp_path, small_dataset, smollm2_dir, "flipped")
    monkeypatch.setenv(FLIP, "flip:0:1")
    refused = train_here(run_cli, path, code=1)
    _refused(refused.stderr)
    assert re.search(
        r"rank 0: (model|optim)\.\S+: 1 of \d+ values differ from what was written \(the first, at flat index \d+: ",
        refused.stderr,
    )
    assert _committed(out) == [] and not (out / "final").exists()


def test_without_the_read_back_that_checkpoint_commits_verifies_and_holds_other_numbers(
    small_dataset, smollm2_dir, tmp_path, run_cli, monkeypatch
):
    """The broken variant, `train.read_back: false`: the same flipped bit is committed, `dpo-state verify`
    passes (its hashes were taken of the flipped file), and the checkpoint differs from a clean run's in one value."""
    clean_path, clean = _config(tmp_path, small_dataset, smollm2_dir, "clean", max_steps=1)
    train_here(run_cli, clean_path)
    path, out = _config(tmp_path, small_dataset, smollm2_dir, "unchecked", max_steps=1, read_back=False)
    monkeypatch.setenv(FLIP, "flip:0:1")
    train_here(run_cli, path)
    assert _committed(out) == ["step-000001"]
    state_here(run_cli, "verify", out)
    diff = state_here(
        run_cli,
        "diff",
        clean / "checkpoints" / "step-000001",
        out / "checkpoints" / "step-000001",
        "--values",
        code=None,
    )
    assert re.search(r"(model|optim)\.\S+", diff.stdout), diff.stdout[-2000:]


def test_a_resumed_process_reads_its_own_first_save_back(small_dataset, smollm2_dir, tmp_path, run_cli, monkeypatch):
    """Each process reads back its first save: the resumed run's first (step 2) too, maybe under another torch."""
    path, out = _config(tmp_path, small_dataset, smollm2_dir, "resumed")
    train_here(run_cli, path, "--set", "train.max_steps=1")
    monkeypatch.setenv(FLIP, "flip:0:2")
    refused = train_here(run_cli, path, code=1)
    assert "saving step 2 failed, nothing was committed" in refused.stderr
    assert "does not read back what was saved; rank 0: " in refused.stderr
    assert _committed(out) == ["step-000001"]


@pytest.mark.parametrize("part", ["loader", "rng"])
def test_rank_files_that_do_not_read_back_are_not_committed(
    small_dataset, smollm2_dir, tmp_path, run_cli, monkeypatch, part
):
    """The loader state and the generator states are read back too: a rank file written with another value
    (here the writer is handed one) stops the run at its first save."""
    from dpo_train.checkpoint import save

    written = save._write_rank_files

    def skewed(directory, rank, loader_state, rng):
        if part == "loader":
            loader_state = {**loader_state, "position": {**loader_state["position"], "step": 99}}
        else:
            states = {k: v.clone() for k, v in rng.state_dict().items()}
            states["cpu"][-1] ^= 1
            rng = type("Skewed", (), {"state_dict": lambda self: states})()
        written(directory, rank, loader_state, rng)

    monkeypatch.setattr(save, "_write_rank_files", skewed)
    path, out = _config(tmp_path, small_dataset, smollm2_dir, part)
    refused = train_here(run_cli, path, code=1)
    _refused(refused.stderr)
    name = {
        "loader": "rank-00000.json does not read back the loader state",
        "rng": "rank-00000.rng.safetensors does not read back the generator states",
    }[part]
    assert name in refused.stderr
    assert _committed(out) == []


def test_the_read_back_in_many_small_groups_passes_a_clean_save_and_finds_the_flip(
    small_dataset, smollm2_dir, tmp_path, run_cli, monkeypatch
):
    """Groups of 4 KiB: every tensor of the tiny model read back in its own DCP load, the same verdicts."""
    from dpo_train.checkpoint import read_back

    monkeypatch.setattr(read_back, "GROUP_BYTES", 4096)
    path, out = _config(tmp_path, small_dataset, smollm2_dir, "grouped")
    train_here(run_cli, path)
    assert _committed(out) == ["step-000001", "step-000002"]
    path, out = _config(tmp_path, small_dataset, smollm2_dir, "grouped-flipped")
    monkeypatch.setenv(FLIP, "flip:0:1")
    _refused(train_here(run_cli, path, code=1).stderr)


def test_groups_are_consecutive_and_sized_from_global_shapes():
    from dpo_train.checkpoint.read_back import GROUP_BYTES, _groups

    big = torch.empty(GROUP_BYTES // 4, device="meta")  # a group alone: sizes count, nothing is allocated
    leaves = [(("a",), torch.empty(4)), (("b",), big), (("c",), torch.empty(4))]
    assert [[k for k, _ in g] for g in _groups(leaves, 2)] == [[("a",)], [("b",)], [("c",)]]
    assert [[k for k, _ in g] for g in _groups(leaves[:1] + leaves[2:], 2)] == [[("a",), ("c",)]]


@pytest.mark.slow
def test_one_flipped_fsdp2_shard_stops_both_ranks(small_dataset, smollm2_dir, tmp_path):
    """Two FSDP2 ranks (DTensor shards, collective loads): a bit flipped in rank 1's file stops both, naming rank 1,
    with nothing committed. (A clean two-rank save reads back in every multi-process test that saves.)"""
    path, out = _config(tmp_path, small_dataset, smollm2_dir, "fsdp-flipped", max_steps=1)
    refused = train_cli(path, nproc=2, env={FLIP: "flip:1:1"}, code=1)
    _refused(refused.stderr, rank=1)
    assert _committed(out) == []
