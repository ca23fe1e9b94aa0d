"""The logged `loss` is TRL's logged `loss`: one real optimizer step of the same tiny model on the same rows.

TRL 1.16's `DPOTrainer.train()` logs the objective it optimizes as `loss`: the weighted list of loss types, the
`sft` term included, plus `router_aux_loss_coef * aux_loss` for a mixture-of-experts model. Our step 1 over
the same four pairs as one step (TRL: one batch of four, no accumulation) must log the same number in
metrics.jsonl. Policy and reference start equal, so the pair part is log 2 on both sides and the rest is the
model's NLL of the chosen tokens (about log 49152 for a random model) or its router statistic: a check that
only the pair part is logged fails by several units (the issue's 0.6931 against 6.1082).
"""

from __future__ import annotations

import json
import math
import warnings

import pytest

from tests.conftest import chat, write_jsonl
from tests.harness import TINY_LLAMA

ROWS = [
    chat("What is 2 plus 3?", "It is 5.", "It is 6, I think."),
    chat("Name a colour.", "Blue.", "A colour is a word."),
    chat("Capital of France?", "Paris.", "Lyon."),
    chat("Say hello.", "Hello!", "No, not right now."),
]


def _model_dir(tmp_path, smollm2_dir, spec: dict):
    """A random model of `spec` saved beside SmolLM2's tokenizer: what both trainers load."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    AutoModelForCausalLM.from_config(AutoConfig.for_model(**spec)).save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(model_dir)
    return model_dir


def _our_step_one(tmp_path, model_dir, loss: dict) -> dict:
    """metrics.jsonl's first record of dpo-train over ROWS: one step of all four pairs in one micro-batch."""
    from dpo_data.prepare.build import BuildOptions, build
    from dpo_train.config.loading import load_config
    from dpo_train.trainer import train

    rows = write_jsonl(tmp_path / "rows.jsonl", ROWS)
    assert build([str(rows)], str(model_dir), tmp_path / "data", BuildOptions()).manifest["totals"]["pairs"] == 4
    config = {
        "model": {"path": str(model_dir)},
        "data": {"path": str(tmp_path / "data"), "pairs_per_step": 4, "max_tokens_per_microbatch": 1024},
        "loss": loss,
        "train": {"output_dir": str(tmp_path / "ours"), "max_steps": 1, "save_every": 0},
    }
    train(load_config(config), progress=False)
    return json.loads((tmp_path / "ours" / "metrics.jsonl").read_text().splitlines()[0])


def _trls_step_one(tmp_path, model_dir, **keys) -> float:
    """The `loss` TRL's DPOTrainer logs for its first step over ROWS, one batch of four."""
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        args = DPOConfig(
            output_dir=str(tmp_path / "trl"),
            per_device_train_batch_size=4,
            max_steps=1,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            bf16=False,
            **keys,
        )
        trainer = DPOTrainer(
            model=AutoModelForCausalLM.from_pretrained(model_dir),
            args=args,
            processing_class=AutoTokenizer.from_pretrained(model_dir),
            train_dataset=datasets.Dataset.from_list(ROWS),
        )
        trainer.train()
    return next(entry["loss"] for entry in trainer.state.log_history if "loss" in entry)


@pytest.mark.slow
def test_a_weighted_list_with_sft_logs_trls_loss(tmp_path, smollm2_dir):
    """[sigmoid, sft] weighed [1, 0.5] (the issue's case): loss = log 2 + 0.5 nll, TRL's number to 1e-5;
    its parts: pair_loss log 2, nll the NLL per chosen token."""
    model_dir = _model_dir(tmp_path, smollm2_dir, TINY_LLAMA)
    ours = _our_step_one(tmp_path, model_dir, {"type": ["sigmoid", "sft"], "weights": [1.0, 0.5]})
    trl = _trls_step_one(tmp_path, model_dir, loss_type=["sigmoid", "sft"], loss_weights=[1.0, 0.5])
    assert ours["loss"] == pytest.approx(trl, rel=1e-5)
    assert ours["pair_loss"] == pytest.approx(math.log(2), rel=1e-6)
    assert ours["loss"] == pytest.approx(ours["pair_loss"] + 0.5 * ours["nll"], rel=1e-9)
    assert ours["nll"] > 5  # a random model over 49152 tokens: the NLL term is most of the loss


@pytest.mark.slow
def test_a_mixture_of_experts_logs_trls_loss_with_the_router_term(tmp_path, smollm2_dir):
    """A tiny Qwen3-MoE whose config weighs its router loss 0.5 (both trainers take the model's coefficient):
    loss = log 2 + 0.5 aux_loss, TRL's number to 1e-5 (its padded batch routes the tokens our packed row does)."""
    from tests.architectures.zoo import model_spec

    spec = {**model_spec("qwen3_moe"), "vocab_size": 49152, "router_aux_loss_coef": 0.5}
    model_dir = _model_dir(tmp_path, smollm2_dir, spec)
    ours = _our_step_one(tmp_path, model_dir, {"type": "sigmoid"})
    trl = _trls_step_one(tmp_path, model_dir)
    # the trainer pads a packed row to a multiple of 8 tokens, and padding counts in the router statistic
    # (docs/objective.md, "MoE"): ROWS hold a multiple of 8, so the row has none, as TRL's masked batch
    assert ours["input_tokens"] % 8 == 0, ours["input_tokens"]
    assert ours["aux_loss"] > 0.1  # the router term moves the loss well past the tolerance
    assert ours["loss"] == pytest.approx(trl, rel=1e-5)
    assert ours["loss"] == pytest.approx(ours["pair_loss"] + 0.5 * ours["aux_loss"], rel=1e-9)
    assert ours["pair_loss"] == pytest.approx(math.log(2), rel=1e-6)
