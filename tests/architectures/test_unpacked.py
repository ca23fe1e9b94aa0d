"""The unpacked path: models packing cannot serve run each sequence alone in a padded batch, and score exactly."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dpo_data.dataset.store import PairIds
from dpo_data.loading.microbatch import pack_microbatch, pack_shared_prompt
from dpo_train.config.sections import ModelConfig
from dpo_train.errors import ConfigError
from dpo_train.logps.pairs import pair_logps
from dpo_train.logps.probe import eager_unpacked, probe
from dpo_train.logps.scoring import Scoring
from tests.architectures.zoo import model_spec, pairs, relative_error

LAYOUTS = {"separate": pack_microbatch, "shared_prompt": pack_shared_prompt}
TOLERANCE = 1e-5


def _loaded(model_type: str, attention: str = "auto", layout: str = "separate", mesh=None):
    """The model as `load_model` loads it, and the `Scoring` of its rows (unpacked where it loaded so)."""
    from dpo_train.model.load import load_model
    from dpo_train.parallel.device import placement

    spec = ModelConfig(init={"config": model_spec(model_type), "seed": 0})
    model, unpacked = load_model(spec, attention, placement("cpu", "fp32"), mesh, layout)
    return model, Scoring(unpacked=unpacked)


def _load(model_type: str, attention: str = "auto", layout: str = "separate", mesh=None):
    return _loaded(model_type, attention, layout, mesh)[0]


def _odd_pairs() -> list[PairIds]:
    """One-token completions on both sides of one pair, a one-token prompt, and pairs of unequal lengths."""
    rng = np.random.default_rng(1)
    ids = lambda k: rng.integers(3, 97, size=k).astype(np.int32)
    shapes = [(5, 1, 1), (1, 4, 9), (7, 1, 3)]
    return [PairIds(i, 0, ids(p), ids(c), ids(r)) for i, (p, c, r) in enumerate(shapes)]


@pytest.mark.parametrize("model_type", ["lfm2", "jamba", "bloom"])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_padding_segments_and_one_token_completions_are_exact(model_type, layout):
    (model, scoring), batch_pairs = _loaded(model_type, layout=layout), _odd_pairs()
    assert scoring.unpacked  # auto, for a model packing cannot serve
    batch = LAYOUTS[layout](batch_pairs, pad_to_multiple_of=24)
    assert batch["num_padding_tokens"] > 0 and (batch["segment_role"] == -1).any()  # a padding segment
    with torch.no_grad():
        out = pair_logps(model, batch, scoring)
    assert relative_error(out, eager_unpacked(model, batch_pairs)) < TOLERANCE
    lengths = torch.tensor([[len(p.chosen), len(p.rejected)] for p in batch_pairs], dtype=torch.float32)
    assert torch.equal(torch.stack([out.chosen_tokens, out.rejected_tokens], 1), lengths)


def test_the_unpacked_sums_equal_the_packed_ones_field_by_field():
    """On a model packing serves (Llama), unpacked asked for gives what the segment attention gives:
    sums, token counts, LD-DPO sums and WPO weights, in both layouts."""
    for layout, pack in LAYOUTS.items():
        (packed, as_packed), (unpacked, as_unpacked) = (
            _loaded("llama", "segments", layout),
            _loaded("llama", "unpacked", layout),
        )
        assert not as_packed.unpacked and as_unpacked.unpacked
        batch = pack(pairs(), pad_to_multiple_of=16)
        with torch.no_grad():
            a = pair_logps(packed, batch, as_packed, ld_alpha=0.5, weighting=True)
            b = pair_logps(unpacked, batch, as_unpacked, ld_alpha=0.5, weighting=True)
        for x, y in [(a.chosen, b.chosen), (a.rejected, b.rejected), (a.ld[0], b.ld[0]), (a.ld[1], b.ld[1])]:
            assert torch.allclose(x, y, rtol=TOLERANCE, atol=0), layout
        assert torch.allclose(a.weights, b.weights, rtol=1e-4, atol=0), layout
        assert torch.equal(a.chosen_tokens, b.chosen_tokens) and torch.equal(a.rejected_tokens, b.rejected_tokens)


def test_the_router_loss_of_an_unpacked_row_is_trls_padded_one():
    """Jamba (experts behind Mamba and attention layers): the padded batch is TRL's own, so its
    load-balancing loss is the one TRL adds; and the trainer's coefficient check lets it through."""
    from dpo_train.step.objective import router_aux_coef
    from tests.architectures.test_moe import _padded_aux

    model, scoring = _loaded("jamba")
    with torch.no_grad():
        out = pair_logps(model, pack_microbatch(pairs()), scoring, router_aux=True)
    assert float(out.aux_loss) == pytest.approx(_padded_aux(model, pairs()), rel=1e-5)
    assert router_aux_coef(None, model, model.config._attn_implementation, False, scoring.unpacked) > 0


def test_auto_says_once_on_stderr_that_packing_is_off(capsys):
    _load("lfm2")
    err = capsys.readouterr().err
    assert err.count("note:") == 1, err
    assert "Lfm2ForCausalLM: packing is off for this model (layer 0 is a 'conv' layer" in err
    assert "costs the padding" in err
    _load("falcon")
    assert "FalconForCausalLM: packing is off for this model (its ALiBi attention bias" in capsys.readouterr().err
    _load("llama")
    assert capsys.readouterr().err == ""  # a model packing serves packs, silently


def test_the_unpacked_path_runs_the_models_own_attention():
    assert _load("lfm2").config._attn_implementation == "sdpa"
    assert _load("bloom").config._attn_implementation == "eager"  # transformers has no sdpa for Bloom
    assert _load("gemma2", "unpacked").config._attn_implementation == "eager"  # nor for Gemma2's softcap


def test_packed_paths_and_sequence_parallelism_refuse_these_models_by_name():
    for attention in ("segments", "sdpa", "eager"):
        with pytest.raises(ConfigError, match=r"Lfm2ForCausalLM: layer 0 is a 'conv' layer.*use model.attention auto"):
            _load("lfm2", attention)
    with pytest.raises(ConfigError, match=r"MptForCausalLM: its ALiBi.*attention sdpa packs; use model.attention"):
        _load("mpt", "sdpa")  # named before transformers' own refusal of sdpa, which would name packed paths
    mesh = SimpleNamespace(active=True)
    for attention in ("auto", "unpacked"):
        with pytest.raises(ConfigError, match=r"JambaForCausalLM trains unpacked .*remove distributed.sequence_paral"):
            _load("jamba", attention, mesh=mesh)
    with pytest.raises(ConfigError, match=r"LlamaForCausalLM trains unpacked \(model.attention unpacked\)"):
        _load("llama", "unpacked", mesh=mesh)


@pytest.mark.parametrize("model_type", ["lfm2", "qwen3_next", "falcon"])
def test_the_start_up_probe_runs_on_the_unpacked_path_and_passes(model_type):
    model, scoring = _loaded(model_type)
    for layout in LAYOUTS:
        found = probe(model, layout, None, scoring.unpacked)
        assert found.error < TOLERANCE and found.unpacked


def _packed_row(batch, mesh=None, model=None):
    """The packed row as it is: ids and positions restarting per segment, no mask."""
    return {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}, None


@pytest.mark.parametrize("model_type", ["lfm2", "jamba", "bloom"])
def test_a_packed_row_fed_to_the_model_is_caught(model_type, monkeypatch):
    """The broken variant: the unpacked path switched off (a `Scoring` that packs), so the packed row reaches the
    model. LFM2 and
    Jamba run the segment attention (their attention layers keep segments apart, as the packed paths
    would), so only the conv / Mamba state crosses segments; Bloom gets the bare row, and its ALiBi
    distances span it. The zoo's check and the start-up probe both see it. At random init (std 0.02) a
    mixer adds little to the residual stream, so its leak is 4e-6 (LFM2) to 1e-4 (Jamba) relative; the
    mixer's (Bloom: the attention's) weights are scaled by 4, as a trained one's matter, to show it plainly."""
    from dpo_train.attention import segments

    model = _load(model_type)
    if model_type == "bloom":
        monkeypatch.setattr("dpo_train.logps.pairs.row_inputs", _packed_row)
    else:
        segments.register()
        model.config._attn_implementation = segments.ATTENTION
    with torch.no_grad():
        for name, p in model.named_parameters():
            mixer = any(k in name for k in (".mamba.", ".conv.", ".self_attention."))
            if mixer and p.dim() > 1 and not any(k in name for k in ("x_proj", "dt_proj")):  # in, conv, out
                p.mul_(4)
    with torch.no_grad():
        out = pair_logps(model, pack_microbatch(pairs()), Scoring())
    assert relative_error(out, eager_unpacked(model, pairs())) > 1e-3
    with pytest.raises(ConfigError, match="start-up probe's packed row"):
        probe(model, "separate")


def test_a_microbatch_without_pairs_still_forwards():
    """The trainer's join forward (a rank with no pairs) runs the padding row as one sequence."""
    from dpo_train.attention.inputs import row_inputs

    model, scoring = _loaded("lfm2")
    batch = pack_microbatch([], pad_to_multiple_of=8)
    inputs = row_inputs(batch, None, model, scoring.unpacked)[0]
    assert inputs["input_ids"].shape == inputs["attention_mask"].shape == (1, 8)
    assert model(**inputs).logits.shape == (1, 8, 97)


def test_unpacked_is_a_valid_model_attention():
    from dpo_state.schema import load_schema

    schema = load_schema("train-config")
    assert "unpacked" in schema["properties"]["model"]["properties"]["attention"]["enum"]


@pytest.mark.slow
def test_dpo_train_trains_a_hybrid_model(tmp_path, small_dataset, smollm2_dir):
    """dpo-train on a tiny LFM2 (conv + attention): two steps, step 1's loss log 2 (policy == reference),
    exit 0, and the note on stderr."""
    import yaml
    from click.testing import CliRunner

    from dpo_cli.train import main

    spec = {**model_spec("lfm2"), "vocab_size": 49152}
    config = {
        "model": {"init": {"config": spec, "seed": 0}, "tokenizer": str(smollm2_dir)},
        "data": {"path": str(small_dataset), "batching": "pairs", "pairs_per_step": 4},
        "train": {"output_dir": str(tmp_path / "run"), "max_steps": 2, "save_every": 2},
    }
    path = tmp_path / "lfm2.yaml"
    path.write_text(yaml.safe_dump(config))
    result = CliRunner().invoke(main, [str(path)], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "packing is off for this model" in result.output
    records = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 2
    assert steps[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)
    assert steps[1]["loss"] != steps[0]["loss"]
