"""What policy and reference share: a length-dependent rope trains exactly, step 1's alone check catches it undone
(the parity guard cannot), PhiMoE's routing threshold is no dropout, and auto falls back to a path it checked."""

from __future__ import annotations

import contextlib
import json

import pytest
import torch

from dpo_data.loading.microbatch import pack_microbatch
from dpo_train.config.sections import ModelConfig
from dpo_train.errors import ConfigError, ParityError
from dpo_train.logps.scoring import Scoring
from tests.architectures.zoo import LONGROPE, ZOO, model_spec, pairs
from tests.architectures.zoo import train_config as _config
from tests.harness import join_gloo, spawn, train_here

THRESHOLD = 49
"""The small dataset's sequences are 45 to 56 tokens: step 1's four pairs lie on both sides of 49."""


LONG = {
    "original_max_position_embeddings": THRESHOLD,
    "rope_parameters": {**LONGROPE, "original_max_position_embeddings": THRESHOLD},
}


def _undo_the_rope_fix(monkeypatch) -> None:
    """The mutant: every rotary module computes from the whole row's largest position, as transformers does."""
    import dpo_train.attention.rope as rope

    monkeypatch.setattr(rope, "sequence_lengths", lambda model, lengths: contextlib.nullcontext())


def _loss(tmp_path, name="run") -> float:
    return json.loads((tmp_path / name / "metrics.jsonl").read_text().splitlines()[0])["loss"]


def test_longrope_trains_exactly_and_the_alone_check_catches_it_undone(
    tmp_path, small_dataset, smollm2_dir, run_cli, monkeypatch
):
    """Phi-3 longrope switching at 49 tokens, step 1's pairs on both sides: the per-sequence rope makes step 1's
    loss log 2 and the check passes. Undone (probe off, which would see it first), the parity guard stays silent
    (policy and reference share the error) and the alone check stops the run, naming the pair and finding no
    path exact; with it off the run trains to the end on wrong numbers, as it did before."""
    path = _config(tmp_path, small_dataset, smollm2_dir, "phi3_longrope", LONG)
    train_here(run_cli, path)
    assert _loss(tmp_path) == pytest.approx(0.693147, abs=1e-6)
    _undo_the_rope_fix(monkeypatch)
    out = lambda name: ("--set", "train.probe_packing=false", "--set", f"train.output_dir={tmp_path / name}")  # noqa: E731
    tr_dpo = ("--set", "reference.sync_ref_model=true", "--set", "reference.ref_model_sync_steps=1")
    result = train_here(run_cli, path, *out("b"), *tr_dpo, code=2)  # TR-DPO: its live copy first moves after step 1
    assert "step 1, micro-batch 0 on rank 0: Phi3ForCausalLM (attention dpo_segments" in result.output
    assert "with its sequence run alone through the model as loaded" in result.output
    assert "None of segments, sdpa, eager, unpacked scores" in result.output and "Traceback" not in result.output
    assert not (tmp_path / "b" / "final").exists()
    train_here(run_cli, path, *out("c"), "--set", "train.alone_check=false")  # what ran before: exit 0, wrong
    assert _loss(tmp_path, "c") == pytest.approx(0.693147, abs=1e-6)  # the parity guard saw nothing


def test_the_probe_catches_the_rope_undone_at_any_threshold(monkeypatch):
    """The probe's rope check builds its row past the threshold, however long (4096 here, Phi-3-mini-128k's)."""
    from dpo_train.logps.probe import probe

    spec = {**model_spec("phi3_longrope"), "original_max_position_embeddings": 4096}
    spec["rope_parameters"] = {**LONGROPE, "original_max_position_embeddings": 4096}
    spec["max_position_embeddings"] = 8192
    model = _load(spec)
    probe(model, "separate")
    _undo_the_rope_fix(monkeypatch)
    with pytest.raises(ConfigError, match="a sequence of 2048 positions packed beside one of 4097"):
        probe(model, "separate")


def _loaded(spec: dict, attention: str = "auto", layout: str = "separate") -> tuple:
    """The model as `load_model` loads it, and whether its rows run unpacked."""
    from dpo_train.model.load import load_model
    from dpo_train.parallel.device import placement

    return load_model(ModelConfig(init={"config": spec, "seed": 0}), attention, placement("cpu", "fp32"), None, layout)


def _load(spec: dict, attention: str = "auto", layout: str = "separate"):
    return _loaded(spec, attention, layout)[0]


def test_dynamic_ntk_trains_exactly_under_lora_and_the_check_runs_there(
    tmp_path, small_dataset, smollm2_dir, run_cli, monkeypatch
):
    """Llama with dynamic NTK past 49 tokens: log 2 at step 1 with LoRA (the check scores PEFT's model with its
    adapters at zero); undone, the check stops it there too."""
    lora = {"r": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    path = _config(tmp_path, small_dataset, smollm2_dir, "llama_dynamic", {"max_position_embeddings": THRESHOLD})
    train_here(run_cli, path, "--set", f"model.lora={lora}")
    assert _loss(tmp_path) == pytest.approx(0.693147, abs=1e-6)
    _undo_the_rope_fix(monkeypatch)
    result = train_here(
        run_cli, path, "--set", f"model.lora={lora}", "--set", "train.probe_packing=false", "--set",
        f"train.output_dir={tmp_path / 'b'}", code=2,
    )  # fmt: skip
    assert "LlamaForCausalLM" in result.output and "run alone through the model as loaded" in result.output


def test_the_precompute_checks_its_first_micro_batches(tmp_path, small_dataset, smollm2_dir, run_cli, monkeypatch):
    """--precompute-reference scores with the same packing: undone, its first micro-batch is stopped."""
    path = _config(tmp_path, small_dataset, smollm2_dir, "phi3_longrope", LONG)
    sidecar = ("--set", f"reference.path={tmp_path / 'ref'}", "--set", "train.probe_packing=false")
    train_here(run_cli, path, "--precompute-reference", *sidecar)
    _undo_the_rope_fix(monkeypatch)
    result = train_here(run_cli, path, "--precompute-reference", "--overwrite", *sidecar, code=2)
    assert "the reference precompute, micro-batch" in result.output and "Phi3ForCausalLM" in result.output


def test_the_diagnosis_names_a_fix_it_checked(monkeypatch):
    """A packing error only the packed paths make: the check names unpacked, which it ran on the micro-batch."""
    import dpo_train.attention.rope as rope
    from dpo_train.logps.pairs import pair_logps
    from dpo_train.run.alone import check_alone

    model, batch = _load({**model_spec("phi3_longrope")}).eval(), pack_microbatch(pairs(), 16)
    packed_only = lambda batch, shard: batch["position_ids"].amax(-1, keepdim=True) + 1  # noqa: E731 - the row's
    monkeypatch.setattr(rope, "shard_lengths", packed_only)
    with torch.no_grad():
        got = pair_logps(model, batch, Scoring())
    facts = {"arch": "Phi3ForCausalLM", "attention": "dpo_segments", "layout": "separate", "rank": 0}
    with pytest.raises(ParityError) as caught:
        check_alone(
            model,
            (got.chosen, got.rejected),
            batch,
            {**facts, "precision": "fp32", "where": "step 1"},
            False,
            Scoring(),
        )
    assert "Fix, checked on this micro-batch: model.attention unpacked" in str(caught.value)
    monkeypatch.undo()
    with torch.no_grad():
        got = pair_logps(model, batch, Scoring())
    check_alone(
        model, (got.chosen, got.rejected), batch, {**facts, "precision": "fp32", "where": "step 1"}, False, Scoring()
    )


def test_phimoe_keeps_its_routing_threshold_and_is_refused_by_name(
    tmp_path, small_dataset, smollm2_dir, run_cli, monkeypatch
):
    """PhiMoE reads router_jitter_noise in evaluation too (a threshold, not a dropout): training keeps it, and
    with it the routers sample in training, so the run is refused at start-up. The old switch (zeroing it) is
    caught by the alone check at step 1: the model it trained was not the one loaded."""
    import dpo_train.run.initial_policy as initial_policy

    path = _config(tmp_path, small_dataset, smollm2_dir, "phimoe")
    result = train_here(run_cli, path, code=2)
    assert "PhimoeForCausalLM: router_jitter_noise is no dropout probability" in result.output
    assert "samples in training" in result.output and "Traceback" not in result.output
    monkeypatch.setattr(initial_policy, "check_settings", lambda model: [])
    result = train_here(run_cli, path, code=2)
    assert "Found: the config values the run zeroed as dropout" in result.output
    assert "router_jitter_noise" in result.output


def test_every_zoo_model_trains_as_it_evaluates():
    """What disable_dropout zeroes is dropout, and the training forward then equals evaluation, for every zoo
    architecture but PhiMoE (refused above); its router_jitter_noise is given back, input_jitter_noise not."""
    from dpo_train.model.policy import prepare_for_training
    from dpo_train.model.settings import check_settings

    for model_type in sorted(ZOO):
        model = _load(model_spec(model_type), "unpacked")
        prepare_for_training(model)
        if model_type == "phimoe":
            with pytest.raises(ConfigError, match="router_jitter_noise is no dropout"):
                check_settings(model)
            assert model.config.router_jitter_noise == 0.01 and model.config.input_jitter_noise == 0.0
        else:
            assert check_settings(model) == [], model_type


@pytest.mark.parametrize(
    "model_type, taken", [("stablelm", "sdpa"), ("gpt_neo", "unpacked"), ("qwen2_moe", "unpacked")]
)
def test_auto_takes_a_path_it_checked(model_type, taken, capsys):
    """StableLM passes no segments to its attention, GPT-Neo is outside the attention registry, Qwen2-MoE's
    sliding layers pass no window and its router loss rules out sdpa and eager: auto takes the first path the
    probe found exact, saying so; an explicit path that cannot run is refused naming only checked paths."""
    from dpo_train.logps.probe import probe

    model, unpacked = _loaded(model_spec(model_type))
    found = probe(model, "separate", "auto", unpacked)
    if taken == "unpacked":
        assert found.unpacked
    else:
        assert model.config._attn_implementation == taken and "auto takes sdpa" in capsys.readouterr().err
    if model_type == "stablelm":
        with pytest.raises(ConfigError, match=r"use model.attention sdpa or eager or unpacked \(exact on this probe\)"):
            probe(_load(model_spec(model_type), "segments"), "separate", "segments")


def _alone_worker(rank: int, world: int, port: int) -> None:
    """Two FSDP2 ranks, one micro-batch of three pairs and one of none: the empty rank joins every forward."""
    from dpo_data.loading.microbatch import pack_microbatch as pack
    from dpo_train.attention.inputs import row_inputs
    from dpo_train.logps.pairs import pair_logps
    from dpo_train.parallel.sharding import shard
    from dpo_train.run.alone import alone_logps

    join_gloo(rank, world, port)
    model = _load(model_spec("phi3_longrope")).eval()
    shard(model, "fsdp", world)
    batch = pack(pairs() if rank == 0 else [], 16)
    got = alone_logps(model, batch)
    with torch.no_grad():
        if rank == 0:
            out = pair_logps(model, batch, Scoring())
            assert torch.allclose(got, torch.stack([out.chosen, out.rejected], 1).double(), rtol=1e-6)
        else:  # the trainer's join of an empty micro-batch
            model(**row_inputs(batch, None, model)[0])
    torch.distributed.destroy_process_group()


def test_the_alone_check_keeps_fsdp_ranks_in_step():
    spawn(_alone_worker, 2)
