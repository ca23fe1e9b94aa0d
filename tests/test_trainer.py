"""The trainer end to end: metrics per step, export, and the same run on 1 process and on 2 (DDP, FSDP2)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from safetensors.torch import load_file


def write_config(tmp_path, dataset, tokenizer_dir, out, strategy="fsdp"):
    config = {
        "model": {"init": {"config": {"model_type": "llama", "vocab_size": 49152, "hidden_size": 32,
                                      "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                                      "num_key_value_heads": 2}, "seed": 0}, "tokenizer": str(tokenizer_dir)},
        "data": {"path": str(dataset), "batching": "pairs", "pairs_per_step": 8, "max_tokens_per_microbatch": 400},
        "optim": {"lr": 1.0e-3},
        "train": {"output_dir": str(out), "max_steps": 3},
        "distributed": {"strategy": strategy},
    }
    path = tmp_path / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run(config, *extra):
    proc = subprocess.run([sys.executable, "-m", "cli.train", str(config), *extra], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single(sample_dataset, smollm2_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train")
    out = tmp / "single"
    run(write_config(tmp, sample_dataset, smollm2_dir, out))
    return out


@pytest.mark.slow
def test_a_run_writes_pair_weighted_metrics_and_a_loadable_policy(single):
    from transformers import AutoModelForCausalLM

    rows = metrics(single)
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["pairs"] == 8 for r in rows)
    assert rows[0]["loss"] == pytest.approx(0.693147, abs=1e-6)  # policy == reference at step 0
    for key in ("rewards/chosen", "rewards/rejected", "rewards/margins", "logps/chosen", "logps/rejected",
                "grad_norm", "lr", "input_tokens", "supervised_tokens", "packing_efficiency", "pairs/s", "tokens/s"):
        assert key in rows[0]
    assert all(0.0 <= r["rewards/accuracies"] <= 1.0 for r in rows)
    for r in rows:  # per source, a pair counts once: the sources add up to the step
        assert sum(v["pairs"] for v in r["sources"].values()) == r["pairs"]
        assert sum(v["input_tokens"] for v in r["sources"].values()) == r["input_tokens"]
        assert sum(v["supervised_tokens"] for v in r["sources"].values()) == r["supervised_tokens"]
    assert AutoModelForCausalLM.from_pretrained(single / "final").config.hidden_size == 32
    assert (single / "config.resolved.yaml").is_file()


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_train_the_same_as_one(single, sample_dataset, smollm2_dir, tmp_path, strategy):
    out = tmp_path / f"two-{strategy}"
    run(write_config(tmp_path, sample_dataset, smollm2_dir, out, strategy), "--nproc-per-node", "2")
    for a, b in zip(metrics(single), metrics(out)):
        assert a["pairs"] == b["pairs"] and a["input_tokens"] == b["input_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
    one, two = load_file(single / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 1e-4


def test_a_config_error_exits_2_naming_the_key(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("optim: {lrr: 1.0e-5}\n")
    proc = subprocess.run([sys.executable, "-m", "cli.train", str(path)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown key optim.lrr (did you mean 'lr'?)" in proc.stderr


@pytest.mark.parametrize("override, message", [
    ("train.save_every=5", "checkpoints are not built yet"),
    ("reference.mode=precomputed", "reference.path is empty"),
    ("reference.mode=none", "needs a reference"),
])
def test_unbuilt_settings_fail_loudly(tmp_path, override, message):
    path = tmp_path / "c.yaml"
    path.write_text("model: {path: /nowhere}\n")
    proc = subprocess.run([sys.executable, "-m", "cli.train", str(path), "--set", override],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and message in proc.stderr
