"""A vision dataset trains through the CLI: `dpo-data build --processor`, `dpo-data verify`, `dpo-train` on each family
(tiny random VLMs), the vision tower frozen unless asked, a changed image refused at training, and the paths a
vision-language model cannot take refused by name."""

from __future__ import annotations

import json
import math
import shutil

import pytest
import torch
from safetensors.torch import load_file

from dpo_data.dataset.store import PairStore
from dpo_data.loading.images import ImageSource
from tests.harness import train_here, write_yaml
from tests.vision.datasets import write_rows
from tests.vision.test_packed_vision import TOWER
from tests.vision.test_vision_loader import _tampered_copy

FAMILIES = ("idefics3", "qwen2_5_vl")


def vision_config(model_dir, dataset, out, **sections) -> dict:
    """Two steps of four pairs on `dataset` with the tiny VLM of `model_dir`; `sections` adds keys per section."""
    config = {
        "model": {"path": str(model_dir)},
        "data": {"path": str(dataset), "pairs_per_step": 4, "max_tokens_per_microbatch": 800},
        "optim": {"lr": 1.0e-3},
        "train": {"output_dir": str(out), "max_steps": 2},
    }
    for section, keys in sections.items():
        config.setdefault(section, {}).update(keys)
    return config


def metrics(out) -> list[dict]:
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def fingerprint(dataset) -> str:
    return json.loads((dataset / "manifest.json").read_text())["processor"]["fingerprint"]


def weights(directory) -> dict[str, torch.Tensor]:
    found = {}
    for file in sorted(directory.glob("*.safetensors")):
        found.update(load_file(file))
    return found


@pytest.mark.parametrize("layout", ["separate", "shared_prompt"])
@pytest.mark.parametrize("family", FAMILIES)
def test_a_vision_dataset_builds_verifies_and_trains_through_the_cli(family, layout, vlm_dirs, run_cli, tmp_path):
    """Real PNG/JPEG files beside the rows, built with the model's processor, verified, and trained two steps at
    world 1: step 1's loss is log 2 (the policy is the reference; the parity guard passed on rows with images),
    every metric finite, the language model moved and the vision tower, frozen by default, did not. `final/` holds
    the processor: the rows built with `--processor final/` attest the same processor fingerprint, and a next run
    takes final/ as its model directory (its loader's processor check passes); its model card's usage snippet is a
    vision-language model's, and it runs."""
    from dpo_cli.data import main as data_main

    model_dir = vlm_dirs[family]
    rows, data, out = write_rows(tmp_path / "input"), tmp_path / "data", tmp_path / "run"
    built = run_cli(data_main, "build", rows, "--processor", model_dir, "--out", data)
    assert built.exit_code == 0, built.output
    verified = run_cli(data_main, "verify", data, "--tokenizer", model_dir)
    assert verified.exit_code == 0, verified.output
    config = write_yaml(tmp_path / "c.yaml", vision_config(model_dir, data, out, data={"layout": layout}))
    train_here(run_cli, config)
    records = metrics(out)
    assert [r["step"] for r in records] == [0, 1]
    assert abs(records[0]["loss"] - math.log(2)) < 1e-6
    assert all(math.isfinite(v) for r in records for v in r.values() if isinstance(v, float))
    before, after = weights(model_dir), weights(out / "final")
    tower = [k for k in before if f".{TOWER[family]}." in f".{k}"]
    moved = [k for k in before if not torch.equal(before[k], after[k])]
    assert tower and moved and not set(tower) & set(moved), "the vision tower must stay as loaded"
    if layout == "separate":  # the export does not depend on the layout
        rebuilt = run_cli(data_main, "build", rows, "--processor", out / "final", "--out", tmp_path / "again")
        assert rebuilt.exit_code == 0, rebuilt.output
        assert fingerprint(tmp_path / "again") == fingerprint(data)
        ImageSource(out / "final", PairStore([data]))  # a DataError, naming what differs, if it did
        card = (out / "final" / "README.md").read_text()
        assert "pipeline_tag: image-text-to-text" in card and "AutoModelForImageTextToText" in card
        if family == "idefics3":  # Qwen2.5-VL's AutoProcessor needs torchvision (its video part), not installed
            _run_usage(card, out / "final", tmp_path / "input" / "image-0.png")


def _run_usage(card: str, final, image) -> None:
    """The card's usage snippet, run on the export and a real image: it loads, asks and prints an answer."""
    code = card.split("## Usage\n\n```python\n", 1)[1].split("\n```", 1)[0]
    code = code.replace("YOUR-NAME/YOUR-MODEL", str(final)).replace("picture.png", str(image))
    code = code.replace("max_new_tokens=64", "max_new_tokens=4")  # a random model: any 4 tokens will do
    exec(code, {})


def test_the_vision_tower_trains_when_asked_and_lora_adapts_the_language_model_only(
    vlm_dirs, vision_datasets, run_cli, tmp_path
):
    model_dir, data = vlm_dirs["qwen2_5_vl"], vision_datasets["qwen2_5_vl"]
    out = tmp_path / "tower"
    config = vision_config(model_dir, data, out, model={"train_vision_tower": True}, train={"max_steps": 1})
    train_here(run_cli, write_yaml(tmp_path / "t.yaml", config))
    before, after = weights(model_dir), weights(out / "final")
    assert any(not torch.equal(before[k], after[k]) for k in before if ".visual." in f".{k}")
    out = tmp_path / "lora"
    config = vision_config(model_dir, data, out, model={"lora": {"r": 4}}, train={"max_steps": 1})
    train_here(run_cli, write_yaml(tmp_path / "l.yaml", config))
    adapter = load_file(next((out / "final").rglob("adapter_model.safetensors")))
    assert adapter and any("language_model" in k for k in adapter) and not any("visual" in k for k in adapter)


def test_a_changed_image_stops_dpo_train_naming_the_pair(vlm_dirs, vision_datasets, run_cli, tmp_path):
    """One byte of one stored image changed after the build (the shard still reads, its size unchanged): dpo-train
    exits 2 before any step. data.verify full (the default) finds the shard's sha256 changed; with data.verify
    size, which reads no shard whole, the loader finds the image's own sha256 changed and names the pair."""
    index, copy, shard = _tampered_copy(vision_datasets["idefics3"], tmp_path)
    for mode, named in (
        ("full", f"{copy}: {shard}: sha256 differs"),
        ("size", f"pair {index} (dataset {copy}, {shard})"),
    ):
        out = tmp_path / f"run-{mode}"
        config = vision_config(vlm_dirs["idefics3"], copy, out, data={"verify": mode})
        said = train_here(run_cli, write_yaml(tmp_path / f"{mode}.yaml", config), code=2).stderr
        assert named in said and "Traceback" not in said, said[-2000:]
        assert not (out / "metrics.jsonl").exists() or not (out / "metrics.jsonl").read_text().strip()
    assert "image_sha256" in said


def test_what_a_vision_language_model_cannot_take_is_refused_by_name(
    vlm_dirs, vision_datasets, run_cli, tmp_path, smollm2_dir
):
    model_dir, data = vlm_dirs["qwen2_5_vl"], vision_datasets["qwen2_5_vl"]
    cases = [
        ({"model": {"attention": "unpacked"}}, "model.attention unpacked cannot train the vision-language model"),
        ({"model": {"train_vision_tower": True, "lora": {"r": 4}}}, "model.train_vision_tower is true, but model.lora"),
        (
            {
                "model": {
                    "path": None,
                    "init": {
                        "config": {
                            "model_type": "llama",
                            "hidden_size": 64,
                            "num_hidden_layers": 1,
                            "num_attention_heads": 4,
                            "intermediate_size": 64,
                            "vocab_size": 49_200,
                        }
                    },
                    "tokenizer": str(model_dir),
                }
            },
            "holds images, but the model (LlamaForCausalLM) is not a vision-language model",
        ),
    ]
    for k, (sections, message) in enumerate(cases):
        config = vision_config(model_dir, data, tmp_path / f"run-{k}", **sections)
        result = train_here(run_cli, write_yaml(tmp_path / f"c{k}.yaml", config), code=2)
        assert message in result.stderr and "Traceback" not in result.stderr, result.stderr[-2000:]
    shutil.rmtree(tmp_path, ignore_errors=True)


def test_a_precomputed_reference_trains_as_the_live_one(vlm_dirs, vision_datasets, run_cli, tmp_path):
    """`--precompute-reference` scores the vision pairs with their images (its sidecar passes step 1's check
    against the policy), and training on it logs what training on the live reference logs."""
    model_dir, data = vlm_dirs["idefics3"], vision_datasets["idefics3"]
    live = tmp_path / "live"
    train_here(run_cli, write_yaml(tmp_path / "live.yaml", vision_config(model_dir, data, live)))
    side, out = tmp_path / "sidecar", tmp_path / "pre"
    sections = {"reference": {"mode": "precomputed", "path": str(side)}}
    config = write_yaml(tmp_path / "pre.yaml", vision_config(model_dir, data, out, **sections))
    train_here(run_cli, config, "--precompute-reference")
    train_here(run_cli, config)
    for got, want in zip(metrics(out), metrics(live), strict=True):
        assert abs(got["loss"] - want["loss"]) < 1e-6 and abs(got["grad_norm"] - want["grad_norm"]) < 1e-5


def test_a_random_init_of_a_vision_language_model_is_refused_naming_the_fix(
    vlm_dirs, vision_datasets, run_cli, tmp_path
):
    """`model.init` builds text models only: a vision-language model type, as a mapping, a config.json file or a
    model directory, is a config error (exit 2) naming the key, the type, what is allowed and the fix, before any
    dataset or model is loaded (transformers' AutoModelForCausalLM would raise its own ValueError)."""
    model_dir, data = vlm_dirs["idefics3"], vision_datasets["idefics3"]
    specs = {
        "qwen2_5_vl": {"model_type": "qwen2_5_vl"},
        "idefics3": str(model_dir / "config.json"),
        "gemma3": {"model_type": "gemma3"},  # refused by model.path too (families.NOT_YET)
    }
    for k, (model_type, spec) in enumerate([*specs.items(), ("idefics3", str(model_dir))]):
        model = {"path": None, "init": {"config": spec, "seed": 0}, "tokenizer": str(model_dir)}
        config = write_yaml(tmp_path / f"i{k}.yaml", vision_config(model_dir, data, tmp_path / f"run-{k}", model=model))
        said = train_here(run_cli, config, code=2).stderr
        assert f"model.init.config: model_type {model_type} is a vision-language model" in said, said[-2000:]
        assert "text models only" in said and "as model.path instead of model.init" in said
        assert "Traceback" not in said and not (tmp_path / f"run-{k}").exists()
