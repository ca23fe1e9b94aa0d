"""Hostile training: a step that goes non-finite stops the run loudly; every micro-batch is checked for its contract."""

from __future__ import annotations

import json
import re

import pytest
import torch

from tests.harness import TINY_LLAMA, tiny_config, tiny_trainer, train_cli, write_yaml


def _blowup(sample_dataset, smollm2_dir, out, *extra, code):
    """lr 100 with weight decay 10 is in range; the first updates blow the weights up."""
    config = write_yaml(out.parent / "c.yaml", tiny_config(sample_dataset, smollm2_dir, out, max_steps=3, save_every=1))
    return train_cli(config, "--set", "optim.lr=100", "--set", "optim.weight_decay=10", *extra, code=code)


# -- a run that goes non-finite stops, loudly ---------------------------------------------------------------


def test_a_run_that_goes_non_finite_stops_before_the_optimizer_step(sample_dataset, smollm2_dir, tmp_path):
    """Before, this exited 0 with `loss: null` in metrics.jsonl and an all-NaN model in final/."""
    out = tmp_path / "blowup"
    proc = _blowup(sample_dataset, smollm2_dir, out, code=1)
    assert re.search(r"step (\d+): .*not finite on rank\(s\) 0 .*sources ", proc.stderr), proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr and not (out / "final").exists()
    failed = int(re.search(r"step (\d+): ", proc.stderr).group(1))
    checkpoints = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert failed >= 2 and checkpoints[-1] == f"step-{failed - 1:06d}"  # the last good state, counted alike
    logged = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert logged == list(range(failed - 1))  # metrics.jsonl counts the steps done before each


def test_skip_step_logs_and_counts_a_non_finite_step_and_leaves_the_optimizer_alone(
    sample_dataset, smollm2_dir, tmp_path
):
    out = tmp_path / "skips"
    _blowup(
        sample_dataset, smollm2_dir, out, "--set", "train.on_nonfinite=skip_step", "--set", "train.save_every=0", code=0
    )
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    skipped = [r for r in records if r.get("skipped")]
    assert skipped and records[-1]["skipped_steps"] == len(skipped) and skipped[0]["nonfinite_ranks"] == [0]
    assert all(r["lr"] == records[0]["lr"] for r in records)  # constant schedule; nothing else moved it


# -- any loader's micro-batches are checked ------------------------------------------------------------------


def _good_batch():
    import numpy as np

    from dpo_data import pack_microbatch
    from dpo_data.dataset.store import PairIds

    ids = lambda xs: np.array(xs, dtype=np.int32)
    pairs = [PairIds(0, 0, ids([1, 2, 3]), ids([4, 5]), ids([6])), PairIds(1, 0, ids([8]), ids([9]), ids([10, 11]))]
    batch = pack_microbatch(pairs, pad_to_multiple_of=8)
    batch.update(step_pairs=2, microbatch=0, microbatches_in_step=1)
    return batch


def _break(kind):
    batch = _good_batch()
    if kind == "lengths":
        batch["segment_length"][0] += 1
    elif kind == "cu_seqlens":
        batch["cu_seqlens"][1] += 1
    elif kind == "two_chosen":
        batch["segment_role"][1] = 0
    elif kind == "padding_in_a_pair":
        batch["segment_pair"][-1] = 0
    elif kind == "label_on_padding":
        batch["labels"][0, -1] = 7
    elif kind == "label_across_a_boundary":
        batch["labels"][0, int(batch["cu_seqlens"][1]) - 1] = 7
    elif kind == "positions":
        batch["position_ids"][0, int(batch["cu_seqlens"][1])] = 5
    elif kind == "step_pairs":
        batch["step_pairs"] = 1
    elif kind == "pair_fields":
        batch["pair_index"] = batch["pair_index"][:1]
    return batch


KINDS = {
    "lengths": "segment lengths add up to",
    "cu_seqlens": "cu_seqlens does not match",
    "two_chosen": "have 2 chosen segments",
    "padding_in_a_pair": "padding is never part of a pair",
    "label_on_padding": "outside completion segments",
    "label_across_a_boundary": "nothing may predict across a segment boundary",
    "positions": "position_ids do not restart",
    "step_pairs": "step_pairs is 1",
    "pair_fields": "pair_index has 1 entries, num_pairs is 2",
}


def test_a_well_formed_micro_batch_passes_the_contract_check():
    from dpo_data import contract_problems

    assert contract_problems(_good_batch()) == []


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_each_kind_of_malformed_micro_batch_is_named(kind):
    from dpo_data import contract_problems

    problems = contract_problems(_break(kind))
    assert any(KINDS[kind] in p for p in problems), problems


def test_the_trainer_refuses_a_malformed_micro_batch_before_its_forward(sample_dataset):
    from dpo_data.errors import DataError

    config = {
        "model": {"init": {"config": TINY_LLAMA, "seed": 0}},
        "data": {"path": str(sample_dataset)},
        "optim": {"name": "sgd", "lr": 1.0},
        "distributed": {"device": "cpu"},
    }
    trainer = tiny_trainer(config)
    before = [p.detach().clone() for p in trainer.policy.parameters()]
    with pytest.raises(
        DataError, match=r"(?s)micro-batch 0 of step 1 on rank 0 breaks the micro-batch contract.*2 chosen"
    ):
        trainer.microbatch(_break("two_chosen"))
    assert all(p.grad is None for p in trainer.policy.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, trainer.policy.parameters()))
