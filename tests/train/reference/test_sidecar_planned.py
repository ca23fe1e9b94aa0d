"""`--precompute-reference --only-planned`: a sidecar of the pairs a run's steps read, exact, and refused (before the
first step, or at the lookup itself) for a run that reads any other pair."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dpo_data.dataset.store import PairStore
from dpo_data.loading.config import LoaderConfig
from dpo_data.loading.loader import DPOLoader
from dpo_data.loading.microbatch import is_last
from dpo_train.errors import SidecarError
from dpo_train.reference.sidecar import SIDECAR_DOCUMENT, SIDECAR_TABLE, load_sidecar, write_sidecar
from tests.harness import train_here
from tests.train.reference.test_sidecar_guards import _precomputed_config

WEIGHTS = "sha256:" + "0" * 64


@pytest.mark.parametrize(
    "geometry",
    [
        {"batching": "pairs", "pairs_per_step": 4},
        {"batching": "pairs", "pairs_per_step": 4, "weights": (0.5,)},  # each epoch 12 pairs of 24, others each time
        {"batching": "pairs", "pairs_per_step": 5, "world_size": 2, "max_tokens_per_microbatch": 256},
        {"batching": "tokens", "pairs_per_step": None, "max_tokens_per_microbatch": 256, "world_size": 2},
    ],
    ids=["pairs", "pairs-half-weight", "pairs-2-ranks", "tokens-2-ranks"],
)
@pytest.mark.parametrize("steps", [1, 3, 8])  # 8 crosses into the next epochs (6 steps of 4 pairs, 3 at weight 0.5)
def test_the_planned_pairs_are_those_the_loader_hands_out(small_dataset, geometry, steps):
    dirs = [str(small_dataset)]
    world = geometry.get("world_size", 1)
    config = LoaderConfig(**geometry)
    loader = DPOLoader(dirs, config, pad_to_multiple_of=8)
    read: set[int] = set()
    for rank in range(world):
        rank_config = LoaderConfig(**geometry | {"rank": rank})
        taken = 0
        for batch in DPOLoader(dirs, rank_config, pad_to_multiple_of=8):
            read.update(int(i) for i in batch["pair_index"])
            if is_last(batch):
                taken += 1
                if taken == steps:
                    break
    planned = loader.stream.schedule.pairs_in(steps)
    assert planned.tolist() == sorted(read)
    assert 0 < len(planned) <= PairStore(dirs).num_pairs


def _config(tmp_path, small_dataset, smollm2_dir, sidecar):
    data, train = {"pairs_per_step": 4}, {"max_steps": 3, "seed": 0}  # 6 steps an epoch
    return _precomputed_config(tmp_path, small_dataset, smollm2_dir, sidecar, data=data, train=train)[0]


def _losses(run_dir) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_planned_sidecar_holds_exactly_the_runs_pairs_and_trains_as_a_full_one(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    from safetensors.numpy import load_file

    path = _config(tmp_path, small_dataset, smollm2_dir, tmp_path / "planned")
    full = ["--set", f"reference.path={tmp_path / 'full'}", "--set", f"train.output_dir={tmp_path / 'on-full'}"]
    train_here(run_cli, path, "--precompute-reference", "--only-planned")
    train_here(run_cli, path, *full, "--precompute-reference")
    document = json.loads((tmp_path / "planned" / SIDECAR_DOCUMENT).read_text())
    assert document["coverage"] == {"steps": 3, "pairs": 12}
    assert "coverage" not in json.loads((tmp_path / "full" / SIDECAR_DOCUMENT).read_text())
    planned, every = (
        load_file(str(tmp_path / "planned" / SIDECAR_TABLE)),
        load_file(str(tmp_path / "full" / SIDECAR_TABLE)),
    )
    scored = np.flatnonzero(np.isfinite(planned["chosen"]))
    loader = DPOLoader([str(small_dataset)], LoaderConfig(pairs_per_step=4), pad_to_multiple_of=8)
    assert scored.tolist() == loader.stream.schedule.pairs_in(3).tolist()
    assert np.isnan(planned["rejected"][np.setdiff1d(np.arange(24), scored)]).all()
    for side in ("chosen", "rejected"):  # the same values as every pair's table, packed otherwise
        np.testing.assert_allclose(planned[side][scored], every[side][scored], rtol=1e-6, atol=1e-5)
    train_here(run_cli, path)
    train_here(run_cli, path, *full)
    assert _losses(tmp_path / "run") == pytest.approx(_losses(tmp_path / "on-full"), abs=1e-6)


@pytest.mark.parametrize(
    "change", [["train.max_steps=4"], ["data.seed=1"], ["data.pairs_per_step=5"]], ids=["steps", "seed", "batch"]
)
def test_a_run_reading_other_pairs_is_refused_before_its_first_step(
    small_dataset, smollm2_dir, tmp_path, run_cli, change
):
    path = _config(tmp_path, small_dataset, smollm2_dir, tmp_path / "planned")
    train_here(run_cli, path, "--precompute-reference", "--only-planned")
    result = train_here(run_cli, path, *(a for c in change for a in ("--set", c)), code=2)
    steps = 4 if change == ["train.max_steps=4"] else 3
    assert "holds only the pairs of the first 3 steps" in result.output
    assert f"and train.max_steps {steps} steps read" in result.output  # the start check's, not a lookup's
    assert "--precompute-reference --overwrite" in result.output and "--only-planned" in result.output
    assert not (tmp_path / "run" / "metrics.jsonl").exists() or not _losses(tmp_path / "run")  # no step taken


def test_a_resume_past_the_planned_steps_is_refused(small_dataset, smollm2_dir, tmp_path, run_cli):
    """Three steps checkpointed, then the same run asked for a fourth: the table has none of its new pairs."""
    path = _config(tmp_path, small_dataset, smollm2_dir, tmp_path / "planned")
    train_here(run_cli, path, "--precompute-reference", "--only-planned")
    train_here(run_cli, path, "--set", "train.save_every=3")
    result = train_here(run_cli, path, "--set", "train.max_steps=6", "--set", "train.save_every=3", code=2)
    assert "holds only the pairs of the first 3 steps" in result.output
    assert "and train.max_steps 6 steps read" in result.output
    assert len(_losses(tmp_path / "run")) == 3


def _table(path, store, chosen, rejected, steps):
    tokens = np.ones(store.num_pairs, dtype=np.int32)
    scores = SimpleNamespace(chosen=chosen, rejected=rejected, chosen_tokens=tokens, rejected_tokens=tokens)
    write_sidecar(path, scores, store, WEIGHTS, "fp32", "separate", "init", steps=steps)
    return load_sidecar(path, store, WEIGHTS, "fp32", "separate")


def test_a_pair_never_scored_fails_closed_at_the_lookup(small_dataset, tmp_path):
    """The last guard, for a caller that skipped the start check (a loop of its own): a NaN never reaches the loss."""
    store = PairStore([str(small_dataset)])
    chosen, rejected = -np.arange(1.0, 25.0), -np.full(24, 2.0)
    chosen[5:], rejected[5:] = np.nan, np.nan
    table = _table(tmp_path / "s", store, chosen, rejected, steps=1)
    got, _ = table.lookup(torch.tensor([0, 4]), torch.device("cpu"))
    assert got.tolist() == [-1.0, -5.0]
    with pytest.raises(SidecarError, match=r"this micro-batch read 1 others \(first: pair 7\)"):
        table.lookup(torch.tensor([0, 7]), torch.device("cpu"))


@pytest.mark.parametrize("hole", ["one side only", "more than recorded"])
def test_a_planned_table_whose_gaps_are_not_what_it_records_is_refused(small_dataset, tmp_path, hole):
    """A NaN is a gap only where both sides have one and the count matches `coverage.pairs`; any other is a value
    no model computes, refused as such."""
    store = PairStore([str(small_dataset)])
    chosen, rejected = -np.arange(1.0, 25.0), -np.full(24, 2.0)
    chosen[12:], rejected[12:] = np.nan, np.nan
    _table(tmp_path / "ok", store, chosen.copy(), rejected.copy(), steps=3)
    write_sidecar_document = json.loads((tmp_path / "ok" / SIDECAR_DOCUMENT).read_text())
    assert write_sidecar_document["coverage"] == {"steps": 3, "pairs": 12}
    if hole == "one side only":
        chosen[2] = np.nan
        match = r"chosen log-probs must be finite and <= 0; 1 are not \(pair 2: nan\)"
    else:
        chosen[2], rejected[2] = np.nan, np.nan
        tokens = np.ones(24, dtype=np.int32)
        scores = SimpleNamespace(chosen=chosen, rejected=rejected, chosen_tokens=tokens, rejected_tokens=tokens)
        write_sidecar(tmp_path / "bad", scores, store, WEIGHTS, "fp32", "separate", "init", steps=3)
        document = json.loads((tmp_path / "bad" / SIDECAR_DOCUMENT).read_text())
        document["coverage"]["pairs"] = 12  # the record says what the precompute scored; the table lost one
        (tmp_path / "bad" / SIDECAR_DOCUMENT).write_text(json.dumps(document))
        with pytest.raises(SidecarError, match=r"chosen log-probs must be finite and <= 0; 13 are not"):
            load_sidecar(tmp_path / "bad", store, WEIGHTS, "fp32", "separate")
        return
    with pytest.raises(SidecarError, match=match):
        _table(tmp_path / "bad", store, chosen, rejected, steps=3)


def test_only_planned_needs_precompute_reference(small_dataset, smollm2_dir, tmp_path, run_cli):
    path = _config(tmp_path, small_dataset, smollm2_dir, tmp_path / "planned")
    result = train_here(run_cli, path, "--only-planned", code=2)
    assert "--only-planned only applies to --precompute-reference" in result.output
