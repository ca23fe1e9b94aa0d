"""Mixture-of-experts: the router load-balancing loss joins the objective as TRL adds it, weighted by pair share."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpo_data.loading.microbatch import pack_microbatch
from dpo_train.config.sections import ModelConfig
from dpo_train.errors import ConfigError
from dpo_train.logps.pairs import pair_logps
from dpo_train.logps.scoring import Scoring
from dpo_train.step.objective import microbatch_loss, router_aux_coef
from tests.architectures.zoo import model_spec, pairs


def _model(model_type: str, attention: str = "segments"):
    from dpo_train.model.load import load_model
    from dpo_train.parallel.device import placement

    spec = ModelConfig(init={"config": model_spec(model_type), "seed": 0})
    return load_model(spec, attention, placement("cpu", "fp32"), None, "separate")[0]


def _padded_aux(model, pair_list) -> float:
    """transformers' own aux_loss over the padded batch TRL forwards (both completions of every pair,
    right-padded, padding excluded by the attention mask): the term TRL adds (`loss + coef * aux_loss`)."""
    rows = [np.concatenate([p.prompt, c]) for p in pair_list for c in (p.chosen, p.rejected)]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.as_tensor(row, dtype=torch.long), 1
    config = model.config
    saved, config._attn_implementation = config._attn_implementation, "eager"
    try:
        with torch.no_grad():
            return float(model(input_ids=ids, attention_mask=mask, output_router_logits=True, use_cache=False).aux_loss)
    finally:
        config._attn_implementation = saved


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe", "gpt_oss"])
def test_packed_router_loss_equals_trls_padded_one(model_type):
    """A packed row without padding routes the same tokens with the same hidden states as TRL's padded
    batch, so its load-balancing loss is the one TRL adds."""
    model = _model(model_type)
    with torch.no_grad():
        out = pair_logps(model, pack_microbatch(pairs()), Scoring(), router_aux=True)
    assert out.aux_loss is not None
    assert float(out.aux_loss) == pytest.approx(_padded_aux(model, pairs()), rel=1e-5)
    assert pair_logps(model, pack_microbatch(pairs()), Scoring()).aux_loss is None  # not asked: not computed


def test_the_coefficient_is_the_models_unless_set_and_refused_where_it_cannot_be_exact():
    mixtral, llama = _model("mixtral"), _model("llama")
    attention = mixtral.config._attn_implementation
    assert router_aux_coef(None, mixtral, attention, False, False) == 0.001  # MixtralConfig's router_aux_loss_coef
    assert router_aux_coef(0.0, mixtral, attention, False, False) == 0.0
    assert router_aux_coef(0.05, mixtral, attention, False, False) == 0.05
    assert router_aux_coef(None, llama, attention, False, False) == 0.0
    with pytest.raises(ConfigError, match="loss.router_aux_coef is 0.1, but LlamaForCausalLM computes no router"):
        router_aux_coef(0.1, llama, attention, False, False)
    # Llama 4 and GLM-4-MoE have the config key but no load-balancing loss: nothing is added or logged
    for name in ("llama4_text", "glm4_moe"):
        model = _model(name)
        assert hasattr(model.config, "output_router_logits")
        assert router_aux_coef(None, model, model.config._attn_implementation, False, False) == 0.0
        with pytest.raises(ConfigError, match="computes no router load-balancing loss"):
            router_aux_coef(0.01, model, model.config._attn_implementation, False, False)
    with pytest.raises(ConfigError, match="under distributed.sequence_parallel each rank sees a part"):
        router_aux_coef(None, mixtral, attention, True, False)
    with pytest.raises(ConfigError, match="model.attention eager: transformers reads the attention mask"):
        router_aux_coef(None, mixtral, "eager", False, False)
    assert router_aux_coef(0.0, mixtral, "eager", False, False) == 0.0


def _step_loss(microbatches, coef):
    """The step objective summed over micro-batches, each with its pair losses and router loss."""
    step_pairs = sum(len(losses) for losses, _ in microbatches)
    terms = [microbatch_loss(losses, step_pairs, aux_loss=aux, router_aux_coef=coef) for losses, aux in microbatches]
    return float(sum(terms))


def test_the_router_term_is_each_microbatch_weighted_by_its_pairs():
    """What holds: the step objective is sum_m aux_m * n_m / N (a pair-weighted mean of micro-batch
    statistics), whatever order or rank the micro-batches run on. What does not: the value itself depends
    on which pairs share a micro-batch (it is a statistic of the micro-batch), so repacking changes it."""
    a, b = (torch.tensor([0.5, 0.7, 0.9]), torch.tensor(0.2)), (torch.tensor([0.4]), torch.tensor(0.6))
    expected = (0.5 + 0.7 + 0.9 + 0.4) / 4 + 0.01 * (0.2 * 3 + 0.6 * 1) / 4
    assert _step_loss([a, b], 0.01) == pytest.approx(expected, rel=1e-6)
    assert _step_loss([b, a], 0.01) == pytest.approx(expected, rel=1e-6)
    assert _step_loss([a, b], 0.0) == pytest.approx((0.5 + 0.7 + 0.9 + 0.4) / 4, rel=1e-6)
    # the broken variant, a mean of micro-batch router losses, weighs the one-pair micro-batch as three
    assert (0.2 + 0.6) / 2 != pytest.approx((0.2 * 3 + 0.6) / 4)

    model, batch_pairs = _model("mixtral"), pairs()
    with torch.no_grad():
        together = float(pair_logps(model, pack_microbatch(batch_pairs), Scoring(), router_aux=True).aux_loss)
        apart = [pair_logps(model, pack_microbatch([p]), Scoring(), router_aux=True).aux_loss for p in batch_pairs]
    assert abs(together - float(sum(apart)) / len(apart)) > 1e-6  # repacking changes the statistic


def test_a_moe_run_logs_its_router_loss(tmp_path, small_dataset, smollm2_dir):
    """dpo-train on a tiny Mixtral: the step records aux_loss, its loss the objective with the router term,
    and the coefficient is in the run identity."""
    import json

    import yaml

    from dpo_cli.train import main
    from tests.architectures.zoo import BASE

    spec = {**model_spec("mixtral"), "vocab_size": 49152}
    assert BASE["vocab_size"] != spec["vocab_size"]
    config = {
        "model": {"init": {"config": spec, "seed": 0}, "tokenizer": str(smollm2_dir)},
        "data": {"path": str(small_dataset), "batching": "pairs", "pairs_per_step": 4},
        "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1, "save_every": 1},
        "distributed": {"strategy": "ddp"},
    }
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(config))
    from click.testing import CliRunner

    result = CliRunner().invoke(main, [str(path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["aux_loss"] > 0
    assert record["pair_loss"] == pytest.approx(float(np.log(2)), rel=1e-4)  # the DPO part at step 1: log 2
    assert record["loss"] == pytest.approx(record["pair_loss"] + 0.001 * record["aux_loss"], rel=1e-12)
    state = json.loads(next((tmp_path / "run").glob("checkpoints/step-*/state.json")).read_text())
    assert state["identity"]["objective"]["router_aux_coef"] == 0.001
