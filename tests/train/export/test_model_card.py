"""The export as the Hub expects it: a model card with front matter and the run's facts, portable paths, normal
file modes, and export.json hashes that `dpo-state verify` checks."""

from __future__ import annotations

import json
import os
import shutil
import stat
from importlib import metadata
from pathlib import Path

import pytest
import yaml

from dpo_train.config.sections import ModelConfig
from dpo_train.export.model_card import base_model
from tests.harness import TINY_LLAMA, invoke, state_here, tiny_config, train_here, write_yaml
from tests.tiny import tiny_llama_model

LORA = {"r": 2, "alpha": 4, "target_modules": ["q_proj"]}


REVISION = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture(scope="module")
def tiny_base(tmp_path_factory) -> Path:
    """TINY_LLAMA saved where a download of Hub repo me/tiny-base leaves it (huggingface_hub's cache:
    models--me--tiny-base/snapshots/REVISION), with the repo's card stating its licence, so that model.path (an
    absolute path) is a Hub model's local copy."""
    directory = tmp_path_factory.mktemp("hub") / "models--me--tiny-base" / "snapshots" / REVISION
    tiny_llama_model().save_pretrained(directory)
    (directory / "README.md").write_text("---\nlicense: mit\ntags: [tiny]\n---\n\n# tiny-base\n")
    return directory


@pytest.fixture(scope="module")
def lora_run(small_dataset, smollm2_dir, tiny_base, tmp_path_factory) -> Path:
    """Two LoRA steps on a local base model with held-out eval, checkpointed at step 2, exported `both`."""
    tmp = tmp_path_factory.mktemp("card")
    config = tiny_config(small_dataset, smollm2_dir, tmp / "out", max_steps=2, save_every=2, export="both")
    config["model"] = {"path": str(tiny_base), "tokenizer": str(smollm2_dir), "lora": LORA}
    config["eval"] = {"path": str(small_dataset)}
    train_here(invoke, write_yaml(tmp / "card.yaml", config))
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
    common = {
        "base_model": "me/tiny-base",  # the Hub id of the cache snapshot model.path is, not the revision's folder
        "datasets": ["pairs"],
        "license": "mit",  # the base's own card's
        "pipeline_tag": "text-generation",
    }
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
        "A LoRA adapter (PEFT) for `me/tiny-base`, trained by dpo-toolkit on preference pairs for 2 optimizer steps.",
        "An adapter: transformers loads it with `peft` installed, over its base model `me/tiny-base`.",
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
        f"| accuracy | {100 * evals[0]['accuracy']:.1f}% | {100 * evals[1]['accuracy']:.1f}% |",
        f"| loss | {evals[0]['loss']:#.4g} | {evals[1]['loss']:#.4g} |",
        f"| rewards/margins | {evals[0]['rewards/margins']:#.4g} | {evals[1]['rewards/margins']:#.4g} |",
        f"Trained with dpo-toolkit {__version__}, on:\n\n| library | release |\n|---|---|\n| python |",
        f"| torch | {metadata.version('torch')} |\n| torchdata |",
        f"| peft | {metadata.version('peft')} |",  # a LoRA run: PEFT's release too
    ]
    assert [line for line in expected if line not in body] == []
    _, merged = _front_matter(lora_run / "final-merged")
    assert "A fine-tune of `me/tiny-base` with its LoRA adapter merged in" in merged
    assert "An adapter" not in merged


def test_no_exported_text_file_holds_a_local_path(lora_run, small_dataset, smollm2_dir, tiny_base):
    roots = {str(p) for p in (lora_run.parent, small_dataset, smollm2_dir, tiny_base, Path.home())}
    for directory in (lora_run / "final", lora_run / "final-merged"):
        for path in _text_files(directory):
            text = path.read_text()
            assert [r for r in roots if r in text] == [], path
    adapter_config = json.loads((lora_run / "final" / "adapter_config.json").read_text())
    assert adapter_config["base_model_name_or_path"] == "me/tiny-base"  # PEFT wrote tiny_base's absolute path


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
    assert "## Usage" in body and "over its base model" not in body  # a whole model loads alone
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


def test_the_base_model_of_a_hub_cache_snapshot_is_its_repo_id(tmp_path):
    """model.path in huggingface_hub's cache (as given, or through a link to it) names its repo; the folder of a
    revision is no name."""
    from dpo_train.export.hub_metadata import cached_repo_id, hub_model_id

    snapshot = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-360M" / "snapshots" / REVISION
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "link").symlink_to(snapshot)
    assert base_model(ModelConfig(path=str(snapshot))) == "HuggingFaceTB/SmolLM2-360M"
    assert hub_model_id(ModelConfig(path=str(tmp_path / "link"))) == "HuggingFaceTB/SmolLM2-360M"
    assert cached_repo_id(tmp_path / "hub" / "models--gpt2" / "snapshots" / REVISION, "model") == "gpt2"
    assert cached_repo_id(snapshot, "dataset") is None  # a model repo's folder is no dataset's
    local = tmp_path / "mine"
    local.mkdir()
    (local / "config.json").write_text(json.dumps({"_name_or_path": "/home/me/mine"}))
    assert (hub_model_id(ModelConfig(path=str(local))), base_model(ModelConfig(path=str(local)))) == (None, "mine")


def test_the_bundled_model_is_named_and_licensed_as_on_the_hub(smollm2_dir):
    """The materialized SmolLM2 records no Hub name in its config.json: its marker makes it the bundled model, whose
    GGUF metadata names the organization and the licence (general.organization, general.license)."""
    from dpo_train.export.hub_metadata import base_licence, hub_model_id

    model = ModelConfig(path=str(smollm2_dir))
    assert json.loads((smollm2_dir / "config.json").read_text()).get("_name_or_path") is None
    assert hub_model_id(model) == base_model(model) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert base_licence(model) == {"license": "apache-2.0"}


@pytest.mark.parametrize(
    ("card", "expected"),
    [
        ("---\nlicense: apache-2.0\n---\n# x\n", {"license": "apache-2.0"}),
        (
            "---\nlicense: other\nlicense_name: llama3\nlicense_link: LICENSE\n---\n",
            {"license": "other", "license_name": "llama3", "license_link": "LICENSE"},
        ),
        ("---\ntags: [x]\n---\n", {}),  # a card without a licence
        ("# no front matter\n", {}),
        ("---\nlicense: [unclosed\n---\n", {}),  # front matter that does not parse states nothing
        ("---\n- a list\n---\n", {}),
        (None, {}),  # no card at all
    ],
)
def test_the_licence_is_the_one_the_base_models_card_states(tmp_path, card, expected):
    from dpo_train.export.hub_metadata import base_licence

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    if card is not None:
        (tmp_path / "README.md").write_text(card)
    assert base_licence(ModelConfig(path=str(tmp_path))) == expected
    assert base_licence(ModelConfig(init={"config": TINY_LLAMA})) == {}


def test_datasets_are_named_by_hub_id_or_as_the_build_named_its_inputs(
    smollm2_dir, small_dataset, tmp_path, monkeypatch
):
    """An `hf://datasets/...` input (two files of one split) is its repo's id, once; a local file its source name."""
    import huggingface_hub

    from dpo_data.prepare.build import BuildOptions, build
    from dpo_train.export.hub_metadata import dataset_names
    from tests.conftest import chat, write_jsonl

    snapshot = tmp_path / "hub" / "datasets--HuggingFaceH4--ultrafeedback_binarized" / "snapshots" / REVISION
    (snapshot / "data").mkdir(parents=True)
    for k in range(2):
        write_jsonl(snapshot / "data" / f"train_prefs-{k}.jsonl", [chat(f"Q{k}?", "Yes.", "No.")])
    # the download, as huggingface_hub's cache answers it offline: the snapshot's folder
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: str(snapshot))
    spec = "hf://datasets/HuggingFaceH4/ultrafeedback_binarized/data/train_prefs-*.jsonl"
    build([spec], str(smollm2_dir), tmp_path / "hub-data", BuildOptions())
    build(
        [str(write_jsonl(tmp_path / "train.jsonl", [chat("Q?", "Yes.", "No.")]))],
        str(smollm2_dir),
        tmp_path / "named",
        BuildOptions(source="mine"),
    )
    assert dataset_names([str(tmp_path / "hub-data"), str(small_dataset)]) == [
        "HuggingFaceH4/ultrafeedback_binarized",
        "pairs",
    ]
    assert dataset_names([str(tmp_path / "named")]) == ["mine"]  # --source names a local input


@pytest.mark.parametrize(
    ("name", "value", "shown"),
    [
        ("accuracy", 0.8333333333, "83.3%"),
        ("logp_accuracy", 1.0, "100.0%"),
        ("loss", 0.69314718, "0.6931"),
        ("rewards/margins", 0.54, "0.5400"),
        ("nll", 1234.5678, "1235"),
        ("rewards/margins", -0.000123456, "-0.0001235"),
        ("nll", None, "-"),
    ],
)
def test_held_out_metrics_are_rounded_as_people_read_them(name, value, shown):
    from dpo_train.export.model_card import _metric

    assert _metric(name, value) == shown


def _snippet(card: str) -> str:
    return card.split("## Usage\n\n```python\n", 1)[1].split("\n```", 1)[0]


def test_the_cards_usage_snippet_loads_the_export_and_generates(lora_run, capsys):
    """The snippet, run as written with `repo` set to the merged export's folder (a pushed repo holds the same
    files): the tokenizer's chat template builds the prompt and the model answers; a run whose tokenizer has no
    chat template gets a snippet that prompts with text, which runs as well."""
    from types import SimpleNamespace

    from dpo_train.config.loading import load_config
    from dpo_train.export.model_card import _usage

    _, body = _front_matter(lora_run / "final-merged")
    code = _snippet(body)
    assert 'repo = "YOUR-NAME/YOUR-MODEL"' in code and "apply_chat_template" in code
    exec(code.replace("YOUR-NAME/YOUR-MODEL", str(lora_run / "final-merged")), {})
    assert capsys.readouterr().out.strip()
    plain = SimpleNamespace(identity={"tokenizer": {"attestation": {"components": {"chat_template": None}}}})
    code = _snippet(_usage(load_config({}), plain, "transformers"))
    assert "apply_chat_template" not in code and 'tokenizer("The capital of France is"' in code
    exec(code.replace("YOUR-NAME/YOUR-MODEL", str(lora_run / "final-merged")), {})
    assert capsys.readouterr().out.strip()


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
