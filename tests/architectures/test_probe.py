"""The start-up packing probe refuses what packs wrongly (a leaking layer, a dropped window); dpo-train says so."""

from __future__ import annotations

import pytest
import torch

from dpo_train.attention import segments
from dpo_train.config.sections import ModelConfig
from dpo_train.errors import ConfigError
from dpo_train.logps.probe import TOLERANCE, Probed, probe
from dpo_train.logps.scoring import Scoring
from dpo_train.model.policy import load_policy
from tests.architectures.zoo import model_spec
from tests.harness import train_here, write_yaml


def _raw(model_type: str, attention: str = segments.ATTENTION):
    """Loaded without the path check, as a model the static checks do not know would be."""
    segments.register()
    return load_policy(ModelConfig(init={"config": model_spec(model_type), "seed": 0}), attention)


@pytest.mark.parametrize("layout", ["separate", "shared_prompt"])
def test_the_probe_passes_exact_models_and_leaves_them_as_they_were(layout):
    for model_type in ("llama", "gemma2", "gpt_oss", "llama4_text"):
        model = _raw(model_type).train()
        assert probe(model, layout).error <= TOLERANCE
        assert model.training and model.config._attn_implementation == segments.ATTENTION


@pytest.mark.parametrize("model_type", ["lfm2", "qwen3_next"])
def test_the_probe_alone_catches_state_that_crosses_segments(model_type):
    """Loaded raw on the segment attention (never marked to run unpacked): the packed row leaks."""
    with pytest.raises(ConfigError, match=r"start-up probe's packed row gives pair \d's (chosen|rejected) log-prob"):
        probe(_raw(model_type), "separate")


def test_the_probe_catches_a_path_that_drops_the_window(monkeypatch):
    """The broken variant of the segment attention (every layer full causal, as before) is refused."""
    from dpo_train.attention import features

    real = features.call_attention
    monkeypatch.setattr(
        "dpo_train.attention.segments.call_attention",
        lambda module, path, kwargs: (features.LayerAttention(), real(module, path, kwargs)[1]),
    )
    with pytest.raises(ConfigError, match="relative error"):
        probe(_raw("mistral"), "separate")


def _config(tmp_path, dataset, tokenizer_dir, model_type, **model):
    spec = {**model_spec(model_type), "vocab_size": 49152}
    config = {
        "model": {"init": {"config": spec, "seed": 0}, "tokenizer": str(tokenizer_dir), **model},
        "data": {"path": str(dataset), "batching": "pairs", "pairs_per_step": 4},
        "train": {"output_dir": str(tmp_path / "run"), "max_steps": 1},
        "distributed": {"strategy": "ddp"},
    }
    return write_yaml(tmp_path / "config.yaml", config)


def test_dpo_train_refuses_an_attention_the_model_cannot_run_in_one_line(tmp_path, small_dataset, smollm2_dir, run_cli):
    result = train_here(run_cli, _config(tmp_path, small_dataset, smollm2_dir, "gemma2", attention="sdpa"), code=2)
    assert "model.attention sdpa: transformers refuses it for this model" in result.output
    assert "Traceback" not in result.output and len(result.output.strip().splitlines()) == 1
    result = train_here(run_cli, _config(tmp_path, small_dataset, smollm2_dir, "lfm2", attention="segments"), code=2)
    assert "layer 0 is a 'conv' layer" in result.output and "use model.attention auto or unpacked" in result.output


def test_dpo_train_runs_the_probe_before_step_1_and_it_can_be_switched_off(
    tmp_path, small_dataset, smollm2_dir, run_cli, monkeypatch
):
    calls = []
    import dpo_train.run.scoring_checks as initial  # the trainer's and the precompute's initial policy's checks

    probed = lambda model, layout, requested, unpacked: calls.append(layout) or Probed(0.0, unpacked)  # noqa: E731
    monkeypatch.setattr(initial, "probe", probed)
    path = _config(tmp_path, small_dataset, smollm2_dir, "gemma3_text")
    train_here(run_cli, path)
    assert calls == ["separate"]
    train_here(run_cli, path, "--set", "train.probe_packing=false", "--set", "train.resume=never")
    assert calls == ["separate"]


def test_an_attention_keyword_that_is_not_inert_reaches_an_error_not_a_silent_drop():
    model = _raw("llama")
    from dpo_data.loading.microbatch import pack_microbatch
    from dpo_train.logps.pairs import pair_logps
    from tests.architectures.zoo import pairs

    with pytest.raises(Exception, match="returns no attention weights"):
        with torch.no_grad():
            model(**{**_inputs(pack_microbatch(pairs())), "output_attentions": True})
    assert pair_logps(model, pack_microbatch(pairs()), Scoring()).chosen.shape == (3,)


def _inputs(batch):
    from dpo_train.attention.segments import row_segments

    return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "row_segments": row_segments(batch)}
