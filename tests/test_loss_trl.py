"""sigmoid, ipo and hinge against TRL 1.16's own loss code on identical log-probabilities.

TRL computes its loss inside `DPOTrainer._compute_loss(model, inputs)`, from the per-token log-probs the
model returns. A stand-in model returns per-token log-probs whose row sums are our summed log-probs,
and the reference log-probs go in as precomputed: TRL's real code then turns them into its loss.
"""

from __future__ import annotations

import types
import warnings

import pytest
import torch

from dpo_train.loss import LossConfig, pair_losses

CHOSEN = torch.tensor([-10.0, -4.0, -7.5, -3.0])
REJECTED = torch.tensor([-12.0, -3.0, -7.5, -9.0])
REF_CHOSEN = torch.tensor([-11.0, -4.5, -7.0, -3.5])
REF_REJECTED = torch.tensor([-11.0, -3.5, -8.0, -8.0])
CHOSEN_TOKENS = torch.tensor([5, 2, 3, 1])
REJECTED_TOKENS = torch.tensor([4, 1, 3, 6])
LENGTH = 9  # sequence length of TRL's padded batch


@pytest.fixture(scope="module")
def trl_trainer(tmp_path_factory, smollm2_dir):
    import datasets
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM
    from trl import DPOConfig, DPOTrainer

    def tiny():
        return LlamaForCausalLM(
            LlamaConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=1,
                num_attention_heads=2,
                num_key_value_heads=2,
                vocab_size=49152,
            )
        )

    row = {"prompt": "Q:", "chosen": " a", "rejected": " b"}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = DPOConfig(output_dir=str(tmp_path_factory.mktemp("trl-loss")), report_to=[], bf16=False, use_cpu=True)
        trainer = DPOTrainer(
            model=tiny(),
            ref_model=tiny(),
            args=args,
            processing_class=AutoTokenizer.from_pretrained(smollm2_dir),
            train_dataset=datasets.Dataset.from_list([row]),
        )
    return trainer


def trl_loss(trainer, loss_type: str, beta: float) -> float:
    n = len(CHOSEN)
    completion = torch.zeros(2 * n, LENGTH, dtype=torch.long)
    for i, count in enumerate(torch.cat([CHOSEN_TOKENS, REJECTED_TOKENS]).tolist()):
        completion[i, LENGTH - count :] = 1  # completion tokens at the end, as TRL's collator lays them out
    per_token = torch.zeros(2 * n, LENGTH - 1)
    per_token[:, -1] = torch.cat([CHOSEN, REJECTED])  # rows sum to our summed log-probs

    def model(**kwargs):
        return types.SimpleNamespace(
            log_probs=per_token,
            entropy=torch.zeros_like(per_token),
            mean_logits=torch.zeros_like(per_token),
            is_top1=torch.zeros_like(per_token, dtype=torch.bool),
        )

    trainer.loss_types, trainer.loss_weights, trainer.beta = [loss_type], [1.0], beta
    trainer.precompute_ref_logps = True
    inputs = {
        "input_ids": torch.zeros(2 * n, LENGTH, dtype=torch.long),
        "attention_mask": torch.ones(2 * n, LENGTH),
        "completion_mask": completion,
        "ref_chosen_logps": REF_CHOSEN,
        "ref_rejected_logps": REF_REJECTED,
    }
    return float(trainer._compute_loss(model, inputs, return_outputs=False))


@pytest.mark.parametrize("loss_type, beta", [("sigmoid", 0.1), ("sigmoid", 0.7), ("ipo", 0.5), ("hinge", 0.3)])
def test_pair_losses_average_to_trls_loss(trl_trainer, loss_type, beta):
    ours = pair_losses(
        LossConfig(type=loss_type, beta=beta),
        CHOSEN,
        REJECTED,
        REF_CHOSEN,
        REF_REJECTED,
        CHOSEN_TOKENS,
        REJECTED_TOKENS,
    ).losses.mean()
    assert float(ours) == pytest.approx(trl_loss(trl_trainer, loss_type, beta), rel=1e-6, abs=1e-7)
