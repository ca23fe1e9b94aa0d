"""Early stopping on a held-out metric: the rule, a run that ends by it, and a resume that counts on."""

from __future__ import annotations

import json

import pytest

from dpo_train.step.early_stopping import EarlyStopping
from tests.harness import tiny_config, train_here, write_yaml


def _records(metric: str, values: list) -> list[dict]:
    return [{"step": step, metric: value} for step, value in enumerate(values)]


@pytest.mark.parametrize(
    "metric, values, stops_at",
    [
        ("loss", [0.69, 0.60, 0.61, 0.62], 3),  # no gain after step 1: the second evaluation without one stops
        ("loss", [0.69, 0.60, 0.59, 0.58], None),  # each a gain
        ("accuracy", [0.0, 0.5, 0.4, 0.3], 3),  # higher is better
        ("accuracy", [0.0, 0.5, 0.6, 0.7], None),
        ("loss", [0.69, None, 0.68, float("nan")], None),  # not finite: no gain, and a gain resets the count
        ("loss", [0.69, None, float("nan")], 2),
        ("rewards/margins", [0.0, 0.001, 0.002], 2),  # below the threshold of 0.005: no gain
    ],
)
def test_patience_counts_evaluations_without_a_gain_beyond_the_threshold(metric, values, stops_at):
    watch = EarlyStopping(metric, patience=2, threshold=0.005 if metric == "rewards/margins" else 0.0)
    stopped = [watch.update(record) for record in _records(metric, values)]
    assert (stopped.index(True) if True in stopped else None) == stops_at
    again = EarlyStopping(metric, patience=2, threshold=watch.threshold)
    again.load_state_dict(watch.state_dict())
    assert again == watch  # what a checkpoint keeps is the whole watch


def _config(tmp_path, dataset, tokenizer, name: str, **eval_keys) -> tuple:
    out = tmp_path / name
    config = tiny_config(dataset, tokenizer, out, max_steps=6, save_every=1)
    config["eval"] = {"path": str(dataset), "every": 1, "early_stopping_metric": "loss", **eval_keys}
    return write_yaml(tmp_path / f"{name}.yaml", config), out


def _steps(out, log: str) -> list[int]:
    return [json.loads(line)["step"] for line in (out / log).read_text().splitlines()]


def test_a_run_stops_after_patience_evaluations_and_a_resume_counts_on(
    small_dataset, smollm2_dir, tmp_path, run_cli, monkeypatch
):
    """No loss gain can beat a threshold of 10, so with patience 3 the evaluations after steps 1, 2 and 3 end
    the run at step 3, which is saved and exported. Cut at step 2 (a fault after its checkpoint) and resumed,
    the run counts on from the checkpoint's watch and stops at step 3 too (counting afresh it would go on to
    step 5); run again once stopped, it trains nothing."""
    keys = {"early_stopping_patience": 3, "early_stopping_threshold": 10.0}
    path, out = _config(tmp_path, small_dataset, smollm2_dir, "whole", **keys)
    result = train_here(run_cli, path)
    assert "early stopping: eval loss has not improved" in result.stderr and "in 3 evaluations" in result.stderr
    assert _steps(out, "metrics.jsonl") == [0, 1, 2] and _steps(out, "eval.jsonl") == [0, 1, 2, 3]
    state = json.loads((out / "checkpoints" / "step-000003" / "state.json").read_text())
    assert state["early_stopping"] == {
        "metric": "loss",
        "best": pytest.approx(json.loads((out / "eval.jsonl").read_text().splitlines()[0])["loss"]),
        "best_step": 0,
        "evals_without_gain": 3,
        "stopped": True,
    }
    assert (out / "final" / "model.safetensors").is_file()

    path, cut = _config(tmp_path, small_dataset, smollm2_dir, "cut", **keys)
    monkeypatch.setenv("DPO_TRAIN_FAULT", "0:2")  # rank 0 fails reading the third step, after the checkpoint of two
    train_here(run_cli, path, code=None)
    monkeypatch.delenv("DPO_TRAIN_FAULT")
    assert _steps(cut, "eval.jsonl") == [0, 1, 2]
    train_here(run_cli, path)
    assert _steps(cut, "metrics.jsonl") == [0, 1, 2] and _steps(cut, "eval.jsonl") == [0, 1, 2, 3]
    again = train_here(run_cli, path)
    assert "early stopping" in again.stderr and _steps(cut, "metrics.jsonl") == [0, 1, 2]


@pytest.mark.parametrize(
    "eval_keys, message",
    [
        ({"every": 0}, "eval.early_stopping_metric is loss, but the run does not evaluate during training"),
        ({"early_stopping_metric": None, "early_stopping_patience": 5}, "eval.early_stopping_patience is 5, but"),
        ({"early_stopping_metric": "ties"}, "eval/early_stopping_metric: 'ties' is not one of"),
    ],
    ids=["no-evaluations", "patience-alone", "unknown-metric"],
)
def test_early_stopping_without_evaluations_or_a_metric_is_refused(eval_keys, message, tmp_path):
    from dpo_train.config.loading import load_config
    from dpo_train.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        load_config({"eval": {"path": "held-out", "every": 2, "early_stopping_metric": "loss", **eval_keys}})
