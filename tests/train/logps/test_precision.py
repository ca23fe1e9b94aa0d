"""bf16 autocast on CPU: per-pair log-probs of the real model stay within a stated tolerance of fp32, and
training in bf16 learns."""

from __future__ import annotations

import math

import pytest
import torch

from dpo_train.logps.scoring import Scoring

BF16_ATOL_PER_TOKEN = 0.05
"""|bf16 - fp32| of a pair's summed completion log-prob, divided by its completion tokens (nats per
token), SmolLM2-135M on the sample. Measured on 16 pairs: up to 0.033 per token, 0.43 per sum (7 % of
a sum), margins moving by up to 0.40: bf16 keeps 8 bits of mantissa in every matmul, while the
log-softmax is taken in fp32. This is why a precomputed reference is bound to its precision."""


@pytest.mark.slow
def test_bf16_log_probs_are_within_tolerance_of_fp32(sample_dataset, smollm2_dir):
    from dpo_data.dataset.store import PairStore
    from dpo_data.loading.microbatch import pack_microbatch
    from dpo_train.config.sections import ModelConfig
    from dpo_train.logps.head import COPIES
    from dpo_train.logps.pairs import pair_logps
    from dpo_train.model.policy import load_policy, prepare_for_training
    from dpo_train.parallel.device import placement

    store = PairStore([str(sample_dataset)])
    batch = pack_microbatch([store.pair(i) for i in range(16)], pad_to_multiple_of=8)
    model = load_policy(ModelConfig(path=str(smollm2_dir)))
    prepare_for_training(model)
    with torch.no_grad():
        exact = pair_logps(model, batch, Scoring())
        with placement("cpu", "bf16").autocast():
            low = pair_logps(model, batch, Scoring())
        chunks = Scoring(logits_budget=16 * COPIES * model.config.vocab_size * 4)  # the chunked head, 16 a chunk
        with placement("cpu", "bf16").autocast():
            chunked = pair_logps(model, batch, chunks)
    assert low.chosen.dtype == chunked.chosen.dtype == torch.float32  # summed in fp32 whatever the matmuls ran in
    for full, half, tokens in (
        (exact.chosen, low.chosen, exact.chosen_tokens),
        (exact.rejected, low.rejected, exact.rejected_tokens),
        (exact.chosen, chunked.chosen, exact.chosen_tokens),  # the chunked head in bf16: within bf16's own rounding
        (exact.rejected, chunked.rejected, exact.rejected_tokens),
    ):
        per_token = ((half - full).abs() / tokens).max()
        assert 0 < per_token < BF16_ATOL_PER_TOKEN, float(per_token)  # bf16 did run (not identical), and stayed close
    # the same bf16 projection row by row: the chunked head rounds as the model's own head does
    for whole, part in ((low.chosen, chunked.chosen), (low.rejected, chunked.rejected)):
        assert float((part - whole).abs().max()) < 1e-3 * float(whole.abs().max())


def test_training_in_bf16_learns(sample_dataset):
    from dpo_data.dataset.store import PairStore
    from dpo_data.loading.microbatch import pack_microbatch
    from tests.harness import tiny_trainer
    from tests.train.test_invariance import MODEL

    config = {
        "model": {"init": {"config": MODEL, "seed": 0}},
        "data": {"path": str(sample_dataset), "pairs_per_step": 8, "max_tokens_per_microbatch": 1024},
        "optim": {"lr": 1.0e-2},
        "train": {"precision": "bf16"},
        "distributed": {"device": "cpu"},
    }
    store = PairStore([str(sample_dataset)])
    trainer = tiny_trainer(config, store=store)  # placed at the config's bf16
    pairs = [store.pair(i) for i in range(8)]
    losses = []
    for _ in range(6):  # the same 8 pairs each step: the loss must fall
        batch = pack_microbatch(pairs, pad_to_multiple_of=8)
        batch.update(
            microbatch=0, microbatches_in_step=1, step_pairs=8, step_chosen_tokens=sum(len(p.chosen) for p in pairs)
        )
        trainer.microbatch(batch)
        losses.append(trainer.step()["loss"])
    assert losses[0] == pytest.approx(math.log(2), abs=1e-3)
    assert losses[-1] < losses[0] - 0.05, losses
    assert all(p.dtype == torch.float32 for p in trainer.policy.parameters())  # fp32 master weights
