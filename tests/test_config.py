"""The training config: the documented keys, overrides, unknown keys with suggestions, schema errors named."""

from __future__ import annotations

import pytest

from dpo_state.schema import schema_problems
from dpo_train.config import load_config
from dpo_train.errors import ConfigError

ISSUE_EXAMPLE = """
model: {path: /models/smol}
reference: {mode: live}
data: {path: /data/train, batching: pairs, pairs_per_step: 8, max_tokens_per_microbatch: 1024,
       microbatches_per_step: 2, num_workers: 0, seed: 0}
loss: {type: sigmoid, beta: 0.1, label_smoothing: 0.0, nll_weight: 0.0, average_log_prob: false}
optim: {lr: 1.0e-5, weight_decay: 0.0, max_grad_norm: 1.0, scheduler: constant, warmup_steps: 0}
train: {output_dir: /runs/x, max_steps: 10, epochs: 1, save_every: 0, keep_last: 3, log_every: 1, seed: 0, resume: auto}
distributed: {strategy: fsdp}
"""


def write(tmp_path, text):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    return path


def test_the_documented_config_loads_typed(tmp_path):
    config = load_config(write(tmp_path, ISSUE_EXAMPLE))
    assert config.data.pairs_per_step == 8 and config.loss.beta == 0.1 and config.distributed.strategy == "fsdp"
    resolved = config.resolved()
    assert schema_problems("train-config", resolved) == []
    assert load_config({k: v for k, v in resolved.items()}) == config  # the resolved form reloads to the same


def test_set_overrides_parse_values_as_yaml(tmp_path):
    config = load_config(
        write(tmp_path, ISSUE_EXAMPLE), ["optim.lr=2e-5", "data.batching=tokens", "loss.average_log_prob=true"]
    )
    assert (config.optim.lr, config.data.batching, config.loss.average_log_prob) == (2e-5, "tokens", True)


def test_unknown_keys_are_errors_with_a_suggestion(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(write(tmp_path, ISSUE_EXAMPLE + "optimizer: {lr: 1}\n"), ["loss.betta=0.2"])
    message = str(info.value)
    assert "unknown section 'optimizer' (did you mean 'optim'?)" in message
    assert "unknown key loss.betta (did you mean 'beta'?)" in message


@pytest.mark.parametrize(
    "override, expected",
    [
        ("data.batching=packed", "data/batching: 'packed' is not one of ['pairs', 'tokens']"),
        ("optim.lr=-1", "optim/lr: -1 is less than or equal to the minimum of 0"),
        ("loss.type=robust", None),
    ],
)
def test_bad_values_are_named_by_path(tmp_path, override, expected):
    if expected is None:  # robust with the default label_smoothing 0 is valid
        assert load_config(write(tmp_path, ISSUE_EXAMPLE), [override]).loss.type == "robust"
        return
    with pytest.raises(ConfigError, match="does not match schemas/train-config.schema.json") as info:
        load_config(write(tmp_path, ISSUE_EXAMPLE), [override])
    assert expected in str(info.value)


def test_section_range_checks_surface_as_config_errors(tmp_path):
    with pytest.raises(ConfigError, match="loss.label_smoothing is 0.5; robust allows"):
        load_config(write(tmp_path, ISSUE_EXAMPLE), ["loss.type=robust", "loss.label_smoothing=0.5"])


def test_a_malformed_override_says_how_to_write_one(tmp_path):
    with pytest.raises(ConfigError, match=r"write section.key=value, e.g. --set optim.lr=2e-5"):
        load_config(write(tmp_path, ISSUE_EXAMPLE), ["lr2e-5"])


def test_the_data_section_holds_the_loader_keys_with_the_loaders_own_defaults():
    """`DataConfig` is written out for readers; its loader keys must stay LoaderConfig's, default for default."""
    from dataclasses import fields

    from dpo_data.loading.config import LoaderConfig
    from dpo_train.config import LOADER_KEYS, DataConfig

    data = {f.name: f.default for f in fields(DataConfig)}
    loader = {f.name: f.default for f in fields(LoaderConfig)}
    assert set(data) - {"path", "verify"} == set(LOADER_KEYS) <= set(loader)
    assert {key: data[key] for key in LOADER_KEYS} == {key: loader[key] for key in LOADER_KEYS}
