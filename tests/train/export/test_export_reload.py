"""An export is loaded back as a user loads it before it is moved into place (train.read_back): a save that writes
other weights leaves no final/, where before it shipped them."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from tests.harness import state_here, tiny_config, train_here, write_yaml
from tests.tiny import tiny_llama

LORA = {"r": 2, "alpha": 4, "target_modules": ["q_proj"]}


def _config(tmp_path, dataset, tokenizer, name, lora=None, **train):
    out = tmp_path / name
    config = tiny_config(dataset, tokenizer, out, **{"max_steps": 1, **train})
    untied = tiny_llama(tie_word_embeddings=False)  # a head of its own: a save may drop it
    config["model"]["init"]["config"] = untied
    if lora:
        config["model"]["lora"] = lora
    return write_yaml(tmp_path / f"{name}.yaml", config), out


def _skewed_saves(monkeypatch, skew) -> None:
    """Every save_pretrained (transformers' and PEFT's) writes `skew(state_dict)` instead of what it is handed."""
    import peft
    import transformers

    for cls in (transformers.PreTrainedModel, peft.PeftModel):
        original = cls.save_pretrained

        def save(self, directory, *args, _original=original, state_dict=None, **kwargs):
            return _original(self, directory, *args, state_dict=skew(state_dict), **kwargs)

        monkeypatch.setattr(cls, "save_pretrained", save)


def _nudged(state: dict) -> dict:
    """One value of the first tensor an export holds (an adapter's first lora_A, else the first) moved by one unit
    in the last place."""
    lora = sorted(k for k in state if "lora_A" in k)
    key = lora[0] if lora else sorted(state)[0]
    changed = state[key].clone()
    changed.view(-1)[0] = torch.nextafter(changed.view(-1)[0], torch.tensor(float("inf"), dtype=changed.dtype))
    return {**state, key: changed}


def test_an_export_that_drops_a_weight_is_not_written(small_dataset, smollm2_dir, tmp_path, run_cli, monkeypatch):
    """The untied head left out of the save: from_pretrained fills it with a fresh one, and the check names it."""
    path, out = _config(tmp_path, small_dataset, smollm2_dir, "dropped")
    _skewed_saves(monkeypatch, lambda state: {k: v for k, v in state.items() if k != "lm_head.weight"})
    refused = train_here(run_cli, path, code=1)
    assert (
        "final/ was not written: the export does not load back as the weights it was written from (" in refused.stderr
    )
    assert "\n  - lm_head.weight: " in refused.stderr and " values differ from what was written" in refused.stderr
    assert "train.read_back: false writes the export without this check" in refused.stderr
    assert not (out / "final").exists() and not list(out.glob("final.incomplete-*"))
    assert "Traceback" not in refused.stderr
    # train.save_every 0: no checkpoint was due, so one is saved to keep the trained weights, and named
    kept = out / "checkpoints" / "step-000001"
    assert f"The trained weights of step 1 are in the committed checkpoint {kept}; rerunning the same command" in (
        refused.stderr
    )
    state_here(run_cli, "verify", kept)


def test_the_rerun_after_the_fix_resumes_from_that_checkpoint_and_exports(
    small_dataset, smollm2_dir, tmp_path, run_cli, monkeypatch
):
    """The export's failure cost no training: the same command, once the save writes what it is handed, resumes
    from the kept checkpoint at its last step and writes final/ (as an uninterrupted run's)."""
    clean_path, clean = _config(tmp_path, small_dataset, smollm2_dir, "clean")
    train_here(run_cli, clean_path)
    path, out = _config(tmp_path, small_dataset, smollm2_dir, "rerun")
    with monkeypatch.context() as patched:
        _skewed_saves(patched, _nudged)
        train_here(run_cli, path, code=1)
    rerun = train_here(run_cli, path)
    assert f"resumed from {out / 'checkpoints' / 'step-000001'} at step 1" in rerun.stderr
    ours, theirs = load_file(out / "final" / "model.safetensors"), load_file(clean / "final" / "model.safetensors")
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


@pytest.mark.parametrize("kind", ["whole", "adapter", "merged"])
def test_an_export_with_one_value_changed_is_not_written(
    small_dataset, smollm2_dir, tmp_path, run_cli, monkeypatch, kind
):
    """One unit in the last place of one tensor, in a whole model, a LoRA adapter or the merged model."""
    lora = None if kind == "whole" else LORA
    path, out = _config(tmp_path, small_dataset, smollm2_dir, kind, lora, export=kind if lora else "adapter")
    _skewed_saves(monkeypatch, _nudged)
    refused = train_here(run_cli, path, code=1)
    assert "final/ was not written" in refused.stderr
    assert (
        ": 1 of " in refused.stderr
        and " values differ from what was written (the first, at flat index 0: " in refused.stderr
    )
    assert not (out / "final").exists()


def test_without_the_check_the_changed_export_is_written(small_dataset, smollm2_dir, tmp_path, run_cli, monkeypatch):
    """The broken variant, `train.read_back: false`: the same change ships in final/ (its hashes match it)."""
    path, out = _config(tmp_path, small_dataset, smollm2_dir, "clean")
    train_here(run_cli, path)
    clean = load_file(out / "final" / "model.safetensors")
    path, out = _config(tmp_path, small_dataset, smollm2_dir, "unchecked", read_back=False)
    _skewed_saves(monkeypatch, _nudged)
    train_here(run_cli, path)
    shipped = load_file(out / "final" / "model.safetensors")
    assert [k for k in clean if not torch.equal(clean[k], shipped[k])] == [sorted(clean)[0]]


@pytest.mark.slow
def test_two_fsdp2_ranks_keep_the_trained_weights_when_the_export_does_not_load_back(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    """Rank 0 finds the export's file changed (a bit flipped once written: DPO_TRAIN_EXPORT_FAULT): both ranks stop
    (exit 1), after saving together the checkpoint that keeps the trained weights; no final/."""
    from tests.harness import train_cli

    path, out = _config(tmp_path, small_dataset, smollm2_dir, "fsdp")
    refused = train_cli(path, nproc=2, env={"DPO_TRAIN_EXPORT_FAULT": "flip"}, code=1)
    assert "final/ was not written: the export does not load back" in refused.stderr
    assert "1 of " in refused.stderr and "values differ from what was written" in refused.stderr
    assert not (out / "final").exists()
    state_here(run_cli, "verify", out / "checkpoints" / "step-000001")
