"""The reference-free methods (cpo, simpo, alphapo, orpo) train with reference.mode none and record it."""

from __future__ import annotations

import json
import math

import pytest

from tests.harness import TINY_LLAMA

METHODS = {
    "cpo": {"type": ["cpo", "sft"], "weights": [1.0, 1.0]},  # TRL's CPOTrainer defaults: sigmoid, cpo_alpha 1.0
    "simpo": {"type": "simpo", "beta": 2.0},
    "alphapo": {"type": "alphapo", "beta": 2.0, "alpha": 0.25},
    "orpo": {"type": ["orpo", "sft"], "beta": 0.1},
}


def _config(dataset, out, loss: dict, mode: str = "none"):
    from dpo_train.config.loading import load_config

    return load_config(
        {
            "model": {"init": {"config": TINY_LLAMA, "seed": 0}},
            "data": {"path": str(dataset), "batching": "pairs", "pairs_per_step": 4},
            "loss": loss,
            "reference": {"mode": mode},
            "optim": {"lr": 1.0e-3},
            "train": {"output_dir": str(out), "max_steps": 2, "save_every": 2},
            "distributed": {"device": "cpu"},
        }
    )


@pytest.mark.parametrize("name", list(METHODS))
def test_reference_mode_is_none_for_each_method_whatever_reference_mode_says(name, tmp_path):
    """reference_mode reads loss.needs_reference: none even under the default reference.mode live, so the run
    identity records none (and no live copy or sidecar is built)."""
    from dpo_train.reference.choice import reference_mode

    for mode in ("live", "none"):
        assert reference_mode(_config("x", tmp_path, METHODS[name], mode)) == "none"
    assert reference_mode(_config("x", tmp_path, {"type": "sigmoid"}, "live")) == "live"


def test_each_method_trains_two_steps_without_a_reference(small_dataset, tmp_path):
    """Through dpo_train.trainer.train in process: two finite steps in metrics.jsonl, and the
    checkpoint's run identity says reference mode none."""
    from dpo_train.trainer import train

    for name, loss in METHODS.items():
        out = train(_config(small_dataset, tmp_path / name, loss), progress=False)
        rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
        assert [row["step"] for row in rows] == [0, 1], name
        assert all(math.isfinite(row["loss"]) for row in rows), (name, rows)
        states = sorted(out.glob("**/state.json"))
        assert states, f"{name}: no checkpoint state under {out}"
        reference = json.loads(states[-1].read_text())["identity"]["reference"]
        assert reference["mode"] == "none", (name, reference)
