"""Step 1's parity guard: the policy's training forward equals the reference on the run's own micro-batches, or
the run stops before the optimizer steps; the mutants (dropout left on, a row-position layer) are caught."""

from __future__ import annotations

import pytest
import torch

from dpo_data.loading.contract import contract_problems
from dpo_data.loading.microbatch import pack_microbatch, pack_shared_prompt
from dpo_train.config.sections import ModelConfig
from dpo_train.errors import ParityError
from dpo_train.logps.pairs import pair_logps
from dpo_train.logps.scoring import Scoring
from dpo_train.reference.guard import check_parity, reordered
from tests.architectures.zoo import model_spec, pairs, relative_error
from tests.architectures.zoo import train_config as _config
from tests.harness import train_here

LAYOUTS = {"separate": pack_microbatch, "shared_prompt": pack_shared_prompt}


def _model(model_type: str, attention: str = "auto", layout: str = "separate", **overrides):
    from dpo_train.model.load import load_model
    from dpo_train.parallel.device import placement

    spec = ModelConfig(init={"config": {**model_spec(model_type), **overrides}, "seed": 0})
    return load_model(spec, attention, placement("cpu", "fp32"), None, layout)[0].eval()


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_a_reordered_micro_batch_keeps_the_contract_and_moves_every_segment(layout):
    batch = LAYOUTS[layout](pairs(), 16)
    again = reordered(batch)
    assert contract_problems({**again, "step_pairs": 3}) == []
    assert not torch.equal(again["input_ids"], batch["input_ids"])
    assert sorted(again["input_ids"][0].tolist()) == sorted(batch["input_ids"][0].tolist())
    starts = (
        lambda b: {  # (pair slot, role) -> where its segment starts in the row
            (int(p), int(r)): int(c) for p, r, c in zip(b["segment_pair"], b["segment_role"], b["cu_seqlens"][:-1])
        }
    )
    moved = [key for key, start in starts(again).items() if key[0] >= 0 and start != starts(batch)[key]]
    assert len(moved) >= 3 * 2 - 1  # every completion but at most one sits elsewhere
    assert reordered(reordered(batch))["input_ids"].shape == batch["input_ids"].shape


@pytest.mark.parametrize("model_type", ["llama", "gemma2", "gpt_oss", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_an_exact_model_scores_a_reordered_batch_as_the_batch(model_type, layout):
    model, batch = _model(model_type, layout=layout), LAYOUTS[layout](pairs(), 16)
    with torch.no_grad():
        want, got = pair_logps(model, batch, Scoring()), pair_logps(model, reordered(batch), Scoring())
    truth = torch.stack([want.chosen, want.rejected], 1).double()
    assert relative_error(got, truth) < 1e-6
    assert torch.equal(got.chosen_tokens, want.chosen_tokens)


def test_check_parity_names_the_pair_both_values_and_the_causes():
    batch = pack_microbatch(pairs())
    facts = {"arch": "SeedOssForCausalLM", "attention": "segments", "layout": "separate", "rank": 1}
    policy = (torch.tensor([-10.0, -2.0, -30.0]), torch.tensor([-11.0, -3.0, -31.0]))
    check_parity(policy, (policy[0] + 1e-6, policy[1] - 1e-6), batch, {**facts, "precision": "fp32"})
    with pytest.raises(ParityError) as caught:
        check_parity(policy, (policy[0], policy[1] + torch.tensor([0, 0, 0.5])), batch, {**facts, "precision": "fp32"})
    message = str(caught.value)
    assert "rank 1: SeedOssForCausalLM" in message and "pair 2's rejected completion -31.000000" in message
    assert "-30.500000 as the reference" in message and "dropout still on" in message
    with pytest.raises(ParityError, match="pair 0's chosen"):  # a NaN is never equal
        check_parity((policy[0] * float("nan"), policy[1]), policy, batch, {**facts, "precision": "fp32"})
    check_parity(policy, (policy[0] * 1.004, policy[1]), batch, {**facts, "precision": "bf16"})
    with pytest.raises(ParityError, match="bf16"):  # SmolLM2's pairs under an attention dropout of 0.1: 1e-2
        check_parity(policy, (policy[0] * 1.01, policy[1]), batch, {**facts, "precision": "bf16"})


def test_dropout_is_found_by_name_in_modules_attributes_and_configs():
    """Every dropout-like number is zeroed, wherever the model keeps it, and the export sees the config as loaded."""
    from dpo_train.model.policy import disable_dropout, dropout_as_loaded, load_policy

    spec = {**model_spec("seed_oss"), "residual_dropout": 0.1, "attention_dropout": 0.2}
    model = load_policy(ModelConfig(init={"config": spec, "seed": 0}), "eager")
    model.extra = torch.nn.Dropout(0.3)  # a module, as PEFT's or a custom head's
    model.model.layers[0].mlp.hidden_pdrop = 0.4  # an attribute under another name
    model.config.router_jitter_noise = 0.05  # MoE router noise: also only in training
    zeroed = disable_dropout(model)
    assert {"extra (p)", "model.layers.0.mlp.residual_dropout", "model.layers.0.mlp.hidden_pdrop"} <= set(zeroed)
    assert {"config.residual_dropout", "config.attention_dropout", "config.router_jitter_noise"} <= set(zeroed)
    assert model.extra.p == 0 and model.config.residual_dropout == 0
    with dropout_as_loaded(model):
        assert (model.config.residual_dropout, model.config.router_jitter_noise) == (0.1, 0.05)
    assert model.config.residual_dropout == 0.0
    ids = torch.randint(3, 97, (1, 24))
    model.train()
    trained = model(input_ids=ids).logits
    assert torch.equal(trained, model.eval()(input_ids=ids).logits)


def test_the_weights_fingerprint_takes_zero_dim_tensors():
    """Apertus keeps its activation's beta and eps as 0-dim buffers (it traced back in the fingerprint)."""
    from dpo_train.model.policy import load_policy
    from dpo_train.reference.sidecar import weights_fingerprint

    model = load_policy(ModelConfig(init={"config": model_spec("apertus"), "seed": 0}), "eager")
    zero_dim = [name for name, t in model.state_dict().items() if t.dim() == 0]
    assert zero_dim
    before = weights_fingerprint(model)
    model.get_buffer(zero_dim[0]).add_(1.0)
    assert weights_fingerprint(model) != before


SEED_OSS = {"residual_dropout": 0.1, "attention_dropout": 0.1}


def test_seed_oss_trains_with_its_residual_dropout_off(tmp_path, small_dataset, smollm2_dir, run_cli):
    """Seed-OSS applies `config.residual_dropout` with F.dropout: off now, so step 1's loss is log 2."""
    import json

    train_here(run_cli, _config(tmp_path, small_dataset, smollm2_dir, "seed_oss", SEED_OSS))
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["loss"] == pytest.approx(0.693147, abs=1e-6)
    exported = json.loads((tmp_path / "run" / "final" / "config.json").read_text())
    assert exported["residual_dropout"] == 0.1  # the export keeps the model's own dropout


def test_the_guard_stops_a_run_whose_dropout_stays_on(tmp_path, small_dataset, smollm2_dir, run_cli, monkeypatch):
    """The mutant: dropout left on (the old module-only switch) is exit 2 at step 1, nothing stepped or saved."""
    import dpo_train.model.policy as model_module

    monkeypatch.setattr(model_module, "disable_dropout", lambda model: [])
    path = _config(tmp_path, small_dataset, smollm2_dir, "seed_oss", SEED_OSS, save_every=1)
    result = train_here(run_cli, path, code=2)
    assert "step 1, micro-batch 0 on rank 0: SeedOssForCausalLM" in result.output
    assert "Nothing was stepped" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "run" / "final").exists() and not list((tmp_path / "run").glob("checkpoints/step-*"))
    # the alone check sees it too (the training forward is not the model as loaded); at the user's own risk,
    # both off let it train
    result = train_here(run_cli, path, "--set", "train.parity_guard=false", "--set", "train.save_every=0", code=2)
    assert "Found: evaluation mode scores these pairs packed as alone, the training forward does not" in result.output
    off = ("--set", "train.parity_guard=false", "--set", "train.alone_check=false", "--set", "train.save_every=0")
    train_here(run_cli, path, *off)


def test_the_guard_runs_under_lora_and_the_shared_prompt_layout(
    tmp_path, small_dataset, smollm2_dir, run_cli, monkeypatch
):
    """LoRA's reference is the policy with its adapters off, scored in eval mode: a dropout left on differs."""
    import dpo_train.model.policy as model_module

    lora = {"r": 4, "alpha": 8, "dropout": 0.5, "target_modules": ["q_proj", "v_proj"]}
    path = _config(tmp_path, small_dataset, smollm2_dir, "seed_oss", SEED_OSS)
    train_here(run_cli, path, "--set", f"model.lora={lora}", "--set", "data.layout=shared_prompt")
    monkeypatch.setattr(model_module, "disable_dropout", lambda model: [])
    result = train_here(run_cli, path, "--set", f"model.lora={lora}", "--set", "data.layout=shared_prompt", code=2)
    assert "data.layout shared_prompt" in result.output and "PeftModel" not in result.output


def test_llama4_temperature_tuning_packs_exactly_and_the_guard_catches_it_undone(
    tmp_path, small_dataset, smollm2_dir, run_cli, monkeypatch
):
    """Llama 4's NoPE layers scale queries by position against floor_scale (8 here): with the scale taken
    from each token's position, step 1 is log 2. The mutant (transformers' row-index scale, as before)
    passes a probe switched off and is then stopped by the guard alone, at step 1."""
    import json

    import dpo_train.attention.segments as segments

    path = _config(tmp_path, small_dataset, smollm2_dir, "llama4_text", save_every=1)
    train_here(run_cli, path)
    record = json.loads((tmp_path / "run" / "metrics.jsonl").read_text().splitlines()[0])
    assert record["loss"] == pytest.approx(0.693147, abs=1e-6)
    monkeypatch.setattr(segments, "by_position", lambda module, query, positions: query)
    result = train_here(
        run_cli, path, "--set", "train.probe_packing=false", "--set", "train.output_dir=" + str(tmp_path / "b"), code=2
    )
    assert "step 1, micro-batch 0 on rank 0: Llama4ForCausalLM (attention dpo_segments" in result.output
    assert not (tmp_path / "b" / "final").exists()
    segments_only = ("--set", "model.attention=segments", "--set", "train.output_dir=" + str(tmp_path / "c"))
    result = train_here(run_cli, path, *segments_only, code=2)
    assert "start-up probe" in result.output  # the probe, on, catches it first (segments past floor_scale)
    result = train_here(run_cli, path, "--set", "train.output_dir=" + str(tmp_path / "d"))  # auto: a checked path
    assert "model.attention auto takes unpacked" in result.output
    assert json.loads((tmp_path / "d" / "metrics.jsonl").read_text().splitlines()[0])["loss"] == pytest.approx(
        0.693147, abs=1e-6
    )
