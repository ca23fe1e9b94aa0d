"""What `disable_dropout` changed is checked to be dropout: the evaluation forward must not read it."""

from __future__ import annotations

from typing import Any

import torch

from dpo_train.errors import ConfigError
from dpo_train.model.policy import changed_settings, dropout_as_loaded, keep_settings


def check_settings(model: Any) -> list[str]:
    """Give back every config key or module attribute `disable_dropout` zeroed that the model's evaluation
    forward reads (PhiMoE's `router_jitter_noise`: its routers' threshold in evaluation too): a dropout
    probability changes nothing there, so the probe's pairs, scored alone in eval mode, must come out bit for
    bit the same with the value zeroed and as loaded. Returns the keys given back. A model whose training
    forward then still differs from its evaluation forward (it samples in training with such a value) is
    refused by name (ConfigError, exit 2): its policy would not equal its reference at step 1. Costs nothing
    when nothing was zeroed (SmolLM2), else two to four unpacked scorings of the probe's three pairs."""
    keys = sorted({key for _, key, _ in changed_settings(model)})
    if not keys:
        return []
    from dpo_train.logps.probe import eager_unpacked, probe_pairs

    pairs, training = probe_pairs(model), model.training
    score = lambda: eager_unpacked(model, pairs)  # noqa: E731
    try:
        with torch.no_grad():
            model.eval()
            zeroed = score()
            with dropout_as_loaded(model):
                loaded = score()
            if torch.equal(zeroed, loaded):
                return []
            read = [key for key in keys if not torch.equal(_with(model, key, score), zeroed)] or keys
            keep_settings(model, set(read))
            model.train()
            trained = score()
    finally:
        model.train(training)
    if not torch.equal(trained, loaded):
        raise _samples(model, read, loaded, zeroed, trained)
    return read


def _with(model: Any, key: str, score: Any) -> torch.Tensor:
    with dropout_as_loaded(model, {key}):
        return score()


def _samples(model: Any, read: list[str], loaded, zeroed, trained) -> ConfigError:
    """The refusal of a model whose training forward differs from evaluation with values it reads in both."""
    values = ", ".join(f"{key}" for key in read)
    moved = float(((zeroed - loaded).abs() / loaded.abs().clamp(min=1e-6)).max())
    off = float(((trained - loaded).abs() / loaded.abs().clamp(min=1e-6)).max())
    return ConfigError(
        f"{type(model).__name__}: {values} is no dropout probability (its evaluation forward reads it: zeroing it "
        f"moves a start-up probe pair's log-prob by {moved:.1e} relative), so training keeps it as loaded; and with "
        f"it the training forward differs from evaluation (by {off:.1e} relative: the model samples in training, "
        "as PhiMoE's routers do), so the policy would not equal its reference at step 1 and DPO's log-ratios "
        "would not start at 0. No attention path changes that: this model cannot be trained exactly "
        "(docs/train-config.md, supported architectures)"
    )
