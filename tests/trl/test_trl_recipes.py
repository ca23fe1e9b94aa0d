"""Published TRL recipes (tests/trl/fixtures/, each naming its source) translate as they are and train: only the
model and the dataset are swapped, through --set, for a tiny model and a built file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from tests.conftest import write_jsonl
from tests.harness import train_here
from tests.trl.test_trl_user import _model_dir, _ultrafeedback_rows

FIXTURES = Path(__file__).resolve().parent / "fixtures"

RECIPES = {  # lr: the one metrics.jsonl logs at step 0, the scheduler's after that step (step 1's)
    "handbook-zephyr-7b-beta-config_full.yaml": {
        "output_dir": "data/zephyr-7b-dpo-full",
        "steps": 1,  # 1 epoch of 8 pairs, 16 pairs a step (8 x 2 accumulation)
        "lr": 5.0e-7,  # warmup_ratio 0.1 of 1 planned step: 1 warm-up step, so step 1's cosine starts at lr (else 0)
        "build": "--max-length 1024 --num-proc 12 --overlength truncate-prompt`",
        "push": "`dpo-state push data/zephyr-7b-dpo-full/final NAMESPACE/zephyr-7b-dpo-full`",
    },
    "handbook-smollm2-config.yaml": {
        "output_dir": "data/smollm2-1.7B-dpo",
        "steps": 3,  # 3 epochs, one step of 8 pairs each (16 pairs a step: 2 x 8 accumulation)
        "lr": 1.0e-6,  # ceil(0.1 x 3) = 1 warm-up step: step 1's cosine at its start (without: 0.75 lr)
        "build": "--max-length 1024 --num-proc 12 --overlength truncate-prompt`",
        "push": "`dpo-state push data/smollm2-1.7B-dpo/final NAMESPACE/smollm2-1.7B-dpo --private`",
    },
    "trl-example_config.yaml": {
        "output_dir": "trainer_output",
        "steps": 3,  # TRL's defaults: 3 epochs, 8 pairs a step
        "lr": 0.75e-4,  # no warm-up: step 1 of 3 on the cosine, (1 + cos(pi / 3)) / 2 = 0.75
        "build": "--max-length 1024`",
        "push": None,
    },
}


@pytest.fixture(scope="module")
def built(smollm2_dir, tmp_path_factory) -> tuple[Path, Path]:
    """A tiny model directory and 8 UltraFeedback-shaped pairs built for it (the recipes' dataset shape)."""
    from dpo_data.prepare.build import BuildOptions, build

    root = tmp_path_factory.mktemp("recipes")
    model_dir = _model_dir(root, smollm2_dir)
    rows = write_jsonl(root / "ultrafeedback.jsonl", _ultrafeedback_rows(8))
    build([str(rows)], str(model_dir), root / "built", BuildOptions(max_length=1024, overlength="truncate-prompt"))
    return model_dir, root / "built"


@pytest.mark.parametrize("recipe", sorted(RECIPES))
def test_a_published_recipe_translates_unedited_and_trains(recipe, built, tmp_path, run_cli, monkeypatch):
    """The recipe file is read as published: its build-time fields come back as the build command, push_to_hub
    as the `dpo-state push` command, eval_strategy evaluates on the held-out set given with --set, and the
    translated config trains to its planned steps, the warm-up a share of them (warmup_ratio without
    max_steps)."""
    from dpo_cli.train import main

    expect, (model_dir, data) = RECIPES[recipe], built
    monkeypatch.chdir(tmp_path)  # the recipes' output_dir is relative
    for name, value in {"WANDB_MODE": "offline", "WANDB_DIR": tmp_path, "WANDB_CONFIG_DIR": tmp_path}.items():
        monkeypatch.setenv(name, str(value))  # the smollm2 recipe reports to wandb
    swaps = [f"model.path={model_dir}", f"data.path={data}", f"eval.path={data}"]
    translated = run_cli(main, "--from-trl", FIXTURES / recipe, *(arg for s in swaps for arg in ("--set", s)))
    assert translated.exit_code == 0, translated.stderr
    assert f"--tokenizer {model_dir} --out {data} {expect['build']}" in translated.stderr
    assert (expect["push"] in translated.stderr) if expect["push"] else "dpo-state push" not in translated.stderr
    (tmp_path / "train.yaml").write_text(translated.stdout)

    train_here(run_cli, tmp_path / "train.yaml")
    out = tmp_path / expect["output_dir"]
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps[0]["step"] == 0 and steps[0]["lr"] == pytest.approx(expect["lr"], rel=1e-9)
    assert (out / "final" / "model.safetensors").is_file()
    resolved = yaml.safe_load((out / "config.resolved.yaml").read_text())
    assert resolved["model"]["path"] == str(model_dir) and resolved["data"]["path"] == str(data)
    eval_steps = [json.loads(line)["step"] for line in (out / "eval.jsonl").read_text().splitlines()]
    assert eval_steps[0] == 0 and eval_steps[-1] == expect["steps"]
