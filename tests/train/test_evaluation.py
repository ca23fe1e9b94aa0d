"""Held-out evaluation: its loss is the training objective over the held-out pairs as one step."""

from __future__ import annotations

import dataclasses

import pytest

from tests.harness import TINY_LLAMA, tiny_trainer

CONFIGS = [
    # a list with a sorted type (its sorts over the whole set), LD-DPO's sums and the NLL term
    {"type": ["sigmoid", "aot", "sft"], "weights": [1.0, 0.5, 0.3], "ld_alpha": 0.5, "beta": 0.5},
    # WPO's weights (the policy's), per-token means
    {"type": ["ipo", "bco_pair"], "use_weighting": True, "beta": 0.5},
]


def _config(dataset, loss: dict) -> dict:
    return {
        "model": {"init": {"config": TINY_LLAMA, "seed": 0}},
        "data": {"path": str(dataset), "max_tokens_per_microbatch": 300},
        "loss": loss,
        "optim": {"lr": 0.05},  # two steps that move the policy well away from the reference
        "train": {"output_dir": "unused"},
        "distributed": {"device": "cpu"},
    }


def _packed(pairs: list) -> dict:
    """`pairs` as one micro-batch that is the whole step."""
    from dpo_data.loading.microbatch import pack_microbatch

    batch = pack_microbatch(pairs, pad_to_multiple_of=8)
    tokens = sum(len(p.chosen) for p in pairs)
    batch.update(microbatch=0, microbatches_in_step=1, step_pairs=len(pairs), step_chosen_tokens=tokens)
    return batch


def _objective(trainer, pairs: list) -> dict:
    """The training step's objective over `pairs` as one micro-batch, read off its sums; nothing is stepped."""
    from dpo_train.step.metrics import PAIR_SUMS

    trainer.microbatch(_packed(pairs))
    sums = dict(zip(PAIR_SUMS, trainer.sums[0].tolist()))
    trainer.optimizer.zero_grad(set_to_none=True)
    trainer.sums.zero_()
    return {"loss": sums["loss"] / len(pairs), "nll": sums["nll"] / sums["chosen_tokens"]}


@pytest.mark.parametrize("loss", CONFIGS, ids=["sorted-ld-sft", "wpo-means"])
def test_the_held_out_loss_is_the_step_objective_on_those_pairs(small_dataset, loss):
    """After two steps, the eval record's loss (its pairs packed by the evaluator's own plan, in micro-batches
    of at most 300 tokens) equals the trainer's step objective over the same 24 pairs as one micro-batch:
    the pair part plus the NLL term's weight times the NLL per chosen token. Before training it is the
    objective at policy = reference."""
    from dpo_train.evaluation import Evaluator

    trainer = tiny_trainer(_config(small_dataset, loss))
    store = trainer.store
    pairs = [store.pair(i) for i in range(store.num_pairs)]
    evaluator = Evaluator(dataclasses.replace(trainer.run, held_out=store), trainer.reference.initial, trainer.scoring)
    before = evaluator.run(trainer.model, step=0)
    step = _objective(trainer, pairs)
    sft = trainer.config.loss.sft_weight
    assert before["loss"] == pytest.approx(step["loss"] + sft * step["nll"], rel=1e-5)
    for _ in range(2):
        trainer.microbatch(_packed(pairs))
        trainer.step()
    after = evaluator.run(trainer.model, step=2)
    step = _objective(trainer, pairs)
    assert after["format_version"] == 4 and after["pairs"] == 24
    assert after["nll"] == pytest.approx(step["nll"], rel=1e-5)
    assert after["pair_loss"] == pytest.approx(step["loss"], rel=1e-5)
    assert after["loss"] == pytest.approx(step["loss"] + sft * step["nll"], rel=1e-5)
    assert abs(after["loss"] - before["loss"]) > 1e-3  # the policy moved: the check can tell
