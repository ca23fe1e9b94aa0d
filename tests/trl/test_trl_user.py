"""A TRL user's data and config, without hand edits: an UltraFeedback-binarized file, a TRL YAML, a run."""

from __future__ import annotations

import json

import yaml

from tests.conftest import write_jsonl
from tests.harness import train_here
from tests.tiny import tiny_llama_model


def _ultrafeedback_rows(n: int) -> list[dict]:
    """HuggingFaceH4/ultrafeedback_binarized's row shape: a string prompt, chosen and rejected as whole
    conversations that repeat the prompt's user turn, and the columns no pair reads (scores, messages)."""
    rows = []
    for i in range(n):
        prompt = f"What is {i} times {i + 2}?"
        user = {"role": "user", "content": prompt}
        good, bad = f"It is {i * (i + 2)}.", f"It is {i * (i + 2) + 1}, I think."
        rows.append(
            {
                "prompt": prompt,
                "prompt_id": f"id-{i}",
                "chosen": [user, {"role": "assistant", "content": good}],
                "rejected": [user, {"role": "assistant", "content": bad}],
                "messages": [user, {"role": "assistant", "content": good}],
                "score_chosen": 8.0,
                "score_rejected": 4.0,
            }
        )
    return rows


def _model_dir(tmp_path, smollm2_dir):
    """A model directory as a user has one: a (tiny, random) causal LM saved beside its tokenizer."""
    from transformers import AutoTokenizer

    model_dir = tmp_path / "model"
    tiny_llama_model().save_pretrained(model_dir)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(model_dir)
    return model_dir


def test_an_ultrafeedback_file_and_a_trl_config_train_without_hand_edits(smollm2_dir, tmp_path, run_cli):
    """The rows build as they are (the extra columns listed as ignored), `dpo-train --from-trl` turns TRL's
    YAML (its MPO recipe: sigmoid, bco_pair, sft weighted) into a config that trains as saved, and the run's
    step holds per_device_train_batch_size x gradient_accumulation_steps pairs."""
    from dpo_data.prepare.build import BuildOptions, build

    rows = write_jsonl(tmp_path / "ultrafeedback.jsonl", _ultrafeedback_rows(12))
    model_dir = _model_dir(tmp_path, smollm2_dir)
    result = build([str(rows)], str(model_dir), tmp_path / "built", BuildOptions())
    assert result.manifest["totals"]["pairs"] == 12
    ignored = result.manifest["inputs"][0]["ignored_columns"]
    assert ignored == {"prompt_id": 12, "messages": 12, "score_chosen": 12, "score_rejected": 12}

    trl = {
        "model_name_or_path": str(model_dir),
        "dataset_name": str(tmp_path / "built"),
        "output_dir": str(tmp_path / "run"),
        "learning_rate": 1.0e-4,
        "per_device_train_batch_size": 2,
        "gradient_accumulation_steps": 2,
        "max_steps": 2,
        "beta": 0.1,
        "loss_type": ["sigmoid", "bco_pair", "sft"],
        "loss_weights": [0.8, 0.2, 1.0],
        "logging_steps": 1,
        "save_steps": 1,
        "gradient_checkpointing": False,
        "use_cpu": True,
    }
    (tmp_path / "trl.yaml").write_text(yaml.safe_dump(trl))
    from dpo_cli.train import main

    translated = run_cli(main, "--from-trl", str(tmp_path / "trl.yaml"))
    assert translated.exit_code == 0, translated.stderr
    (tmp_path / "train.yaml").write_text(translated.stdout)
    config = yaml.safe_load(translated.stdout)
    assert config["loss"]["type"] == ["sigmoid", "bco_pair", "sft"] and config["data"]["pairs_per_step"] == 4

    train_here(run_cli, tmp_path / "train.yaml")
    steps = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [0, 1] and all(s["pairs"] == 4 for s in steps)
    assert (tmp_path / "run" / "final" / "model.safetensors").is_file()
