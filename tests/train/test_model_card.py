"""The export as the Hub expects it: a model card with front matter and the run's facts, portable paths, normal
file modes, and export.json hashes that `dpo-state verify` checks."""

from __future__ import annotations

import json
import os
import shutil
import stat
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from dpo_train.config.sections import ModelConfig
from dpo_train.export.model_card import base_model
from tests.harness import TINY_LLAMA, state_here, tiny_config, train_here, write_yaml

LORA = {"r": 2, "alpha": 4, "target_modules": ["q_proj"]}


def _runner(main, *args):
    return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    """TINY_LLAMA saved as a local model directory, so that model.path (an absolute path) names the base."""
    from transformers import AutoModelForCausalLM, LlamaConfig

    directory = tmp_path_factory.mktemp("models") / "tiny-base"
    spec = {k: v for k, v in TINY_LLAMA.items() if k != "model_type"}
    AutoModelForCausalLM.from_config(LlamaConfig(**spec)).save_pretrained(directory)
    return directory


@pytest.fixture(scope="module")
def lora_run(small_dataset, smollm2_dir, tiny_base, tmp_path_factory) -> Path:
    """Two LoRA steps on a local base model with held-out eval, checkpointed at step 2, exported `both`."""
    tmp = tmp_path_factory.mktemp("card")
    config = tiny_config(small_dataset, smollm2_dir, tmp / "out", max_steps=2, save_every=2, export="both")
    config["model"] = {"path": str(tiny_base), "tokenizer": str(smollm2_dir), "lora": LORA}
    config["eval"] = {"path": str(small_dataset)}
    train_here(_runner, write_yaml(tmp / "card.yaml", config))
    return tmp / "out"


def _front_matter(directory: Path) -> tuple[dict, str]:
    text = (directory / "README.md").read_text()
    assert text.startswith("---\n")
    head, body = text[4:].split("\n---\n", 1)
    return yaml.safe_load(head), body


def _text_files(directory: Path) -> list[Path]:
    return [p for p in directory.iterdir() if p.is_file() and p.suffix != ".safetensors"]


def test_the_card_front_matter_is_what_the_hub_reads(lora_run):
    adapter, _ = _front_matter(lora_run / "final")
    merged, _ = _front_matter(lora_run / "final-merged")
    common = {"base_model": "tiny-base", "datasets": ["pairs"], "pipeline_tag": "text-generation"}
    tags = ["dpo-toolkit", "dpo", "sigmoid", "lora"]
    assert adapter == {**common, "library_name": "peft", "tags": tags}
    assert merged == {**common, "library_name": "transformers", "tags": tags}


def test_the_card_says_what_made_the_run(lora_run, small_dataset, smollm2_dir):
    from dpo_data import __version__

    _, body = _front_matter(lora_run / "final")
    manifest = json.loads((small_dataset / "manifest.json").read_text())
    state = json.loads((lora_run / "checkpoints" / "step-000002" / "state.json").read_text())
    evals = [json.loads(line) for line in (lora_run / "eval.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 2]
    expected = [
        "A LoRA adapter (PEFT) for `tiny-base`, trained by dpo-toolkit on preference pairs for 2 optimizer steps.",
        "| loss types | sigmoid |\n| reference | live |",
        "| beta | 0.1 |",
        "| learning rate | 0.001 |",
        "| steps trained | 2 |",
        "| pairs per step | 4 |",
        "| precision | fp32 |",
        "| world size | 1 |",
        "| LoRA | r=2, alpha=4, dropout=0, target_modules=q_proj |",
        f"Dataset fingerprint `{manifest['fingerprint']}`, 24 pairs (1 dataset).",
        "| source | pairs |\n|---|---|\n| pairs | 24 |",
        f"Attestation fingerprint `{manifest['tokenizer']['fingerprint']}`",
        f"| run id | {state['lineage']['run_id']} |\n| exported at step | 2 |\n| parent checkpoint | step-000002 |",
        "| held-out (24 pairs) | step 0 (before) | step 2 (after) |",
        f"| accuracy | {evals[0]['accuracy']:.6g} | {evals[1]['accuracy']:.6g} |",
        f"| loss | {evals[0]['loss']:.6g} | {evals[1]['loss']:.6g} |",
        f"Trained with dpo-toolkit {__version__}.",
    ]
    assert [line for line in expected if line not in body] == []
    _, merged = _front_matter(lora_run / "final-merged")
    assert "A fine-tune of `tiny-base` with its LoRA adapter merged in" in merged


def test_no_exported_text_file_holds_a_local_path(lora_run, small_dataset, smollm2_dir, tiny_base):
    roots = {str(p) for p in (lora_run.parent, small_dataset, smollm2_dir, tiny_base, Path.home())}
    for directory in (lora_run / "final", lora_run / "final-merged"):
        for path in _text_files(directory):
            text = path.read_text()
            assert [r for r in roots if r in text] == [], path
    adapter_config = json.loads((lora_run / "final" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "tiny-base"  # PEFT wrote tiny_base's absolute path


def test_every_exported_file_has_the_mode_a_new_file_gets(lora_run):
    umask = os.umask(0)
    os.umask(umask)
    assert umask == 0o022  # the usual umask, the one this suite runs under: 0644
    for directory in (lora_run / "final", lora_run / "final-merged"):
        modes = {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()}
        assert "model.safetensors" in modes or "adapter_model.safetensors" in modes
        assert {name: oct(mode) for name, mode in modes.items() if mode != 0o644} == {}  # safetensors wrote 0600


def test_export_json_lists_every_file_with_its_hash_and_verify_checks_it(lora_run, run_cli):
    from dpo_state.digest import file_digest

    for directory in (lora_run / "final", lora_run / "final-merged"):
        record = json.loads((directory / "export.json").read_text())
        state = json.loads((lora_run / "checkpoints" / "step-000002" / "state.json").read_text())
        assert (record["format_version"], record["step"], record["run_id"]) == (1, 2, state["lineage"]["run_id"])
        on_disk = sorted(p.name for p in directory.iterdir() if p.name != "export.json")
        assert [f["path"] for f in record["files"]] == on_disk
        assert all(f["sha256"] == file_digest(directory / f["path"]) for f in record["files"])
        assert state_here(run_cli, "verify", directory).output == f"ok: {directory}\n"


def test_verify_names_the_changed_missing_and_extra_files_of_an_export(lora_run, tmp_path, run_cli):
    copy = shutil.copytree(lora_run / "final-merged", tmp_path / "final-merged")
    weights = copy / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[len(data) // 2] ^= 1  # one byte of the weights, the size unchanged
    weights.write_bytes(bytes(data))
    (copy / "tokenizer.json").unlink()
    (copy / "notes.txt").write_text("added after the export")
    result = state_here(run_cli, "verify", copy, code=1)
    assert result.stderr == (
        f"FAILED: {copy}\n"
        "  - model.safetensors: sha256 differs from export.json (corrupted or replaced)\n"
        "  - tokenizer.json: missing\n"
        "  - notes.txt: present but not in export.json\n"
    )


def test_a_full_model_without_eval_has_a_card_without_base_model_or_eval(small_dataset, smollm2_dir, tmp_path, run_cli):
    config = tiny_config(small_dataset, smollm2_dir, tmp_path / "out", max_steps=1, save_every=0)
    train_here(run_cli, write_yaml(tmp_path / "full.yaml", config))
    final = tmp_path / "out" / "final"
    front, body = _front_matter(final)
    assert front == {
        "datasets": ["pairs"],
        "library_name": "transformers",
        "pipeline_tag": "text-generation",
        "tags": ["dpo-toolkit", "dpo", "sigmoid"],
    }
    assert "A fine-tune of a randomly initialized llama model" in body and "| parent checkpoint | none |" in body
    assert "Held-out" not in body
    assert stat.S_IMODE((final / "model.safetensors").stat().st_mode) == 0o644
    assert state_here(run_cli, "verify", final).output == f"ok: {final}\n"


@pytest.mark.parametrize(
    ("recorded", "expected"),
    [("HuggingFaceTB/SmolLM2-135M-Instruct",) * 2, ("/abs/cache/x", "base"), ("./x", "base"), ("", "base")],
)
def test_the_base_model_is_a_hub_name_or_the_directory_name_never_a_local_path(tmp_path, recorded, expected):
    directory = tmp_path / "base"
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"_name_or_path": recorded, "model_type": "llama"}))
    assert base_model(ModelConfig(path=str(directory))) == expected
    assert base_model(ModelConfig(init={"config": TINY_LLAMA})) is None


@pytest.fixture
def hub(monkeypatch):
    """huggingface_hub's create_repo and upload_folder replaced by recorders: what a push would send, and
    what the folder held at that moment (file names, and the text of every file but the weights)."""
    import huggingface_hub

    sent: dict = {}

    def create_repo(repo_id, **kwargs):
        sent["create_repo"] = {"repo_id": repo_id, **kwargs}

    def upload_folder(**kwargs):
        folder = Path(kwargs["folder_path"])
        sent["upload_folder"] = kwargs
        sent["files"] = sorted(p.name for p in folder.iterdir())
        sent["texts"] = {p.name: p.read_text() for p in _text_files(folder)}
        return f"https://huggingface.co/{kwargs['repo_id']}/commit/0123"

    monkeypatch.setattr(huggingface_hub, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub, "upload_folder", upload_folder)
    return sent


def test_push_sends_the_verified_export_folder_as_it_is(lora_run, hub, run_cli, small_dataset, smollm2_dir):
    final = lora_run / "final"
    result = state_here(run_cli, "push", final, "me/tiny-dpo", "--token", "hf_test", "--private")
    assert result.output == "https://huggingface.co/me/tiny-dpo/commit/0123\n"
    assert hub["create_repo"] == {
        "repo_id": "me/tiny-dpo",
        "token": "hf_test",
        "private": True,
        "repo_type": "model",
        "exist_ok": True,
    }
    assert hub["upload_folder"] == {
        "repo_id": "me/tiny-dpo",
        "folder_path": final,
        "token": "hf_test",
        "commit_message": "dpo-toolkit export at step 2",
    }
    record = json.loads((final / "export.json").read_text())
    assert hub["files"] == sorted([f["path"] for f in record["files"]] + ["export.json"])
    assert {"README.md", "adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= set(hub["files"])
    roots = {str(p) for p in (lora_run.parent, small_dataset, smollm2_dir, Path.home())}
    assert {name: [r for r in roots if r in text] for name, text in hub["texts"].items()} == {
        name: [] for name in hub["texts"]
    }


def test_push_without_a_token_or_of_a_changed_export_sends_nothing(lora_run, hub, run_cli, monkeypatch, tmp_path):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "get_token", lambda: None)  # no HF_TOKEN, no `hf auth login`
    final = lora_run / "final"
    result = state_here(run_cli, "push", final, "me/tiny-dpo", code=2)
    assert result.stderr == (
        f"error: no Hugging Face token to push {final} to me/tiny-dpo: pass --token, set HF_TOKEN, or run "
        "`hf auth login` (a token with write access)\n"
    )
    copy = shutil.copytree(final, tmp_path / "final")
    (copy / "README.md").write_text("edited")
    result = state_here(run_cli, "push", copy, "me/tiny-dpo", "--token", "hf_test", code=2)
    assert "README.md: 6 bytes, export.json says" in result.stderr and result.stderr.startswith(
        f"error: {copy} does not verify against its export.json"
    )
    assert hub == {}


def test_push_without_network_is_a_named_error(lora_run):
    from tests.harness import free_port, state_cli

    endpoint = f"http://127.0.0.1:{free_port()}"  # nothing listens there: as a machine without network
    result = state_cli(
        "push", lora_run / "final", "me/tiny-dpo", "--token", "hf_test", env={"HF_ENDPOINT": endpoint}, code=2
    )
    assert result.stderr.startswith(
        f"error: pushing {lora_run / 'final'} to the Hub as me/tiny-dpo failed: ConnectError: "
    )
    assert "Traceback" not in result.stderr
