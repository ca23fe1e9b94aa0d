"""The training config: the documented keys, overrides, unknown keys with suggestions, schema errors named."""

from __future__ import annotations

import pytest

from dpo_state.schema import schema_problems
from dpo_train.config.loading import load_config
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
    from dpo_train.config.sections import LOADER_KEYS, DataConfig

    data = {f.name: f.default for f in fields(DataConfig)}
    loader = {f.name: f.default for f in fields(LoaderConfig)}
    assert set(data) - {"path", "verify"} == set(LOADER_KEYS) <= set(loader)
    assert {key: data[key] for key in LOADER_KEYS} == {key: loader[key] for key in LOADER_KEYS}


# -- where the rules live: the schema (each key alone) and config_problems (keys together, the loss registry) --


def test_the_schemas_loss_types_are_the_registrys():
    """The schema's enum is for users' editors; the registry is the family: they must name the same types."""
    from dpo_state.schema import load_schema
    from dpo_train.step.loss import F_DIVERGENCES, LOSSES

    schema = load_schema("train-config")
    loss = schema["properties"]["loss"]["properties"]
    assert schema["$defs"]["loss_type"]["enum"] == list(LOSSES)
    assert loss["type"]["then"] == {"$ref": "#/$defs/loss_type"} == loss["type"]["else"]["items"]
    assert loss["f_divergence_type"]["enum"] == list(F_DIVERGENCES)


def test_every_conflict_is_listed_in_one_error():
    overrides = [
        "loss.type=hinge",
        "loss.label_smoothing=0.2",
        "reference.mode=none",
        "train.weights_from=/ckpt/step-000004",
        "train.resume=/ckpt/step-000002",
        "train.export=merged",
    ]
    with pytest.raises(ConfigError) as info:
        load_config({}, overrides)  # no data.path: that one is a run's to name
    assert str(info.value) == (
        "the config's settings conflict:\n"
        "  - loss.label_smoothing is 0.2, but hinge has none; set it to 0, or use a loss.type that takes it "
        "(sigmoid, robust, simpo, exo_pair, cpo, alphapo, aot, aot_unpaired)\n"
        "  - loss.type hinge needs a reference; set reference.mode: live or precomputed, or use a reference-free "
        "loss.type (simpo, sft, cpo, alphapo, orpo, cpo_hinge, cpo_ipo)\n"
        "  - train.weights_from starts a new run from a checkpoint's weights; it cannot be combined with "
        "train.resume: /ckpt/step-000002; drop one of the two\n"
        "  - train.export is merged, but model.lora is not set: without adapters final/ is always the whole "
        "model; drop train.export, or set model.lora"
    )


SCHEMA = "the config does not match schemas/train-config.schema.json:\n  - "
BOUNDS = ' (docs/train-config.md, "Bounds")'


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["loss.type=kto"],
            SCHEMA + "loss/type: 'kto' is not one of ['sigmoid', 'ipo', 'hinge', 'robust', 'simpo', 'exo_pair', "
            "'nca_pair', 'bco_pair', 'sppo_hard', 'apo_zero', 'apo_down', 'discopop', 'sft', 'sigmoid_norm', 'cpo', "
            "'alphapo', 'orpo', 'cpo_hinge', 'cpo_ipo', 'aot', 'aot_unpaired']",
        ),
        (
            ["loss.beta=0"],
            SCHEMA + "loss/beta: 0 is less than or equal to the minimum of 0; allowed: a number in (0, 1_000]" + BOUNDS,
        ),
        (
            ["loss.nll_weight=-0.5"],
            SCHEMA + "loss/nll_weight: -0.5 is less than the minimum of 0; allowed: a number in [0, 1_000]" + BOUNDS,
        ),
        (
            ["loss.router_aux_coef=-1"],
            SCHEMA
            + "loss/router_aux_coef: -1 is less than the minimum of 0; allowed: a number in [0, 1_000] or null"
            + BOUNDS,
        ),
        (
            ["train.mlp_tile_tokens=many"],
            SCHEMA + "train/mlp_tile_tokens: 'many' does not match '^auto$'; allowed: an integer in [1, 1_048_576], "
            "auto or null" + BOUNDS,
        ),
        (
            ["train.logits_budget_mib=lots"],
            SCHEMA + "train/logits_budget_mib: 'lots' is not of type 'integer', 'null'; allowed: an integer in "
            "[1, 1_048_576] or null" + BOUNDS,
        ),
        (
            ["loss.type=robust", "loss.label_smoothing=0.5"],
            "loss.label_smoothing is 0.5; robust allows [0, 0.5): it is the chance that a pair's labels are "
            "flipped, so at 0.5 chosen and rejected weigh the same and the gradient vanishes at parity (the policy "
            "still the reference), and above 0.5 every preference is flipped; set it below 0.5 (robust DPO's paper "
            "suggests 0.1)",
        ),
        (
            ["loss.type=ipo", "loss.label_smoothing=0.1"],
            "loss.label_smoothing is 0.1, but ipo has none; set it to 0, or use a loss.type that takes it "
            "(sigmoid, robust, simpo, exo_pair, cpo, alphapo, aot, aot_unpaired)",
        ),
        (
            ["reference.mode=precomputed"],
            "reference.mode is precomputed but reference.path is empty; set it to the sidecar directory and "
            "create it with `dpo-train CONFIG --precompute-reference`",
        ),
    ],
    ids=[
        "type",
        "beta",
        "nll_weight",
        "router_aux_coef",
        "tile-word",
        "budget-word",
        "robust-smoothing",
        "ipo-smoothing",
        "sidecar",
    ],
)
def test_each_rule_refuses_its_case_by_name(overrides, message):
    """Once LossConfig's own checks (type, beta, smoothing, nll_weight, router_aux_coef) or the trainer's
    (the reference sidecar): now the schema's bounds or config_problems, both run by load_config."""
    with pytest.raises(ConfigError) as info:
        load_config({"data": {"path": "x"}}, overrides)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "overrides",
    [
        ["loss.type=sigmoid", "loss.label_smoothing=0.49"],
        ["loss.type=robust", "loss.label_smoothing=0.49"],
        ["loss.type=simpo", "reference.mode=none"],
        ["loss.router_aux_coef=null", "loss.nll_weight=0"],
        ["train.weights_from=/ckpt", "train.resume=never", "model.lora={r: 2}", "train.export=both"],
    ],
)
def test_the_edges_of_each_rule_load(overrides):
    load_config({}, overrides)


def test_a_config_without_data_path_loads_and_only_a_run_refuses_it():
    """Tools and tests load partial configs; `check_config` (the run setup's) names the missing dataset."""
    from dpo_train.config.rules import check_config, config_problems

    config = load_config({})
    assert config.data.path == "" and config_problems(config, for_run=False) == []
    with pytest.raises(ConfigError) as info:
        check_config(config)
    assert str(info.value) == (
        "data.path is empty; set it to a dataset directory written by `dpo-data build` (or a list of them)"
    )


def test_a_config_built_in_code_is_checked_against_the_registry_too():
    """The run setup's check covers a TrainConfig that never went through the schema: a bad loss.type is
    named with the registry's names (no KeyError), beside the run's other problems."""
    from dpo_train.config.rules import check_config
    from dpo_train.config.sections import ReferenceConfig, TrainConfig
    from dpo_train.step.loss import LOSSES, LossConfig

    config = TrainConfig(loss=LossConfig(type="kto"), reference=ReferenceConfig(mode="none"))
    with pytest.raises(ConfigError) as info:
        check_config(config)
    assert str(info.value) == (
        "the config's settings conflict:\n"
        f"  - loss.type is 'kto'; allowed: {', '.join(LOSSES)}; set loss.type to one of them "
        '(docs/objective.md, "The loss family")\n'
        "  - data.path is empty; set it to a dataset directory written by `dpo-data build` (or a list of them)"
    )


def test_the_config_rules_read_the_loss_registry(monkeypatch):
    """A type added to `LOSSES` is one entry: its reference need and label_smoothing range are what the
    config's rules check, with no other list of names to update (the schema's enum is the test above's)."""
    from dpo_train.config.rules import config_problems
    from dpo_train.config.sections import ReferenceConfig, TrainConfig
    from dpo_train.step.loss import LOSSES, Interval, LossConfig, LossType

    monkeypatch.setitem(LOSSES, "smoothed", LossType(LOSSES["sigmoid"].form, label_smoothing=Interval(0.0, 0.2)))
    monkeypatch.setitem(LOSSES, "free", LossType(LOSSES["simpo"].form, needs_reference=False))

    def problems(**loss):
        return config_problems(TrainConfig(loss=LossConfig(**loss)), for_run=False)

    assert problems(type="smoothed", label_smoothing=0.2) == []
    assert problems(type="smoothed", label_smoothing=0.3) == [
        "loss.label_smoothing is 0.3; smoothed allows [0, 0.2]; set it inside that range"
    ]
    assert problems(type="hinge", label_smoothing=0.1)[0].endswith(
        "takes it (sigmoid, robust, simpo, exo_pair, cpo, alphapo, aot, aot_unpaired, smoothed)"
    )
    none = config_problems(TrainConfig(reference=ReferenceConfig(mode="none")), for_run=False)  # sigmoid
    assert none[0].endswith(
        "or use a reference-free loss.type (simpo, sft, cpo, alphapo, orpo, cpo_hinge, cpo_ipo, free)"
    )


def test_the_loss_keys_only_some_types_read_follow_the_registry(monkeypatch):
    """`LossType.options` and `f_divergence` decide which keys a type lets change: an entry that reads
    discopop_tau and scores makes both legal, with no list of names in config.py."""
    from dpo_train.config.rules import config_problems
    from dpo_train.config.sections import TrainConfig
    from dpo_train.step.loss import LOSSES, LossConfig, LossType

    def problems(**loss):
        return config_problems(TrainConfig(loss=LossConfig(**loss)), for_run=False)

    assert len(problems(type="bco_pair", discopop_tau=0.2, f_divergence_type="forward_kl")) == 2
    monkeypatch.setitem(
        LOSSES, "bco_pair", LossType(LOSSES["bco_pair"].form, f_divergence=True, options=("discopop_tau",))
    )
    assert problems(type="bco_pair", discopop_tau=0.2, f_divergence_type="forward_kl") == []


# -- a list of loss types: loss.type [a, b], loss.weights, and the keys that must agree with them --


def test_a_list_of_types_loads_and_reloads_from_its_resolved_form():
    config = load_config(
        {"data": {"path": "x"}}, ["loss.type=[sigmoid, bco_pair, sft]", "loss.weights=[0.8, 0.2, 1.0]"]
    )
    assert (config.loss.type, config.loss.weights, config.loss.sft_weight) == (
        ["sigmoid", "bco_pair", "sft"],
        [0.8, 0.2, 1.0],
        1.0,
    )
    assert load_config(config.resolved()) == config


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["loss.type=[sigmoid, kto]"], SCHEMA + "loss/type/1: 'kto' is not one of ['sigmoid', 'ipo'"),
        (["loss.type=[]"], SCHEMA + "loss/type: [] should be non-empty"),
        (["loss.type=[sigmoid]", "loss.weights=[-0.5]"], SCHEMA + "loss/weights/0: -0.5 is less than the minimum of 0"),
        (
            ["loss.type=[sigmoid, hinge, sigmoid, sigmoid]"],
            "loss.type [sigmoid, hinge, sigmoid, sigmoid] names sigmoid more than once; list each type once "
            "(its weight in loss.weights says how much it counts)",
        ),
        (
            ["loss.weights=[0.5]"],
            "loss.weights is [0.5], but loss.type is the one type sigmoid; weights combine a list of types: drop "
            "loss.weights, or write loss.type as a list ([sigmoid, ...])",
        ),
        (
            ["loss.type=[sigmoid, bco_pair]", "loss.weights=[1.0]"],
            "loss.weights has 1 weights for the 2 types of loss.type [sigmoid, bco_pair]; give one weight per "
            "type, in its order (or drop loss.weights: 1.0 each)",
        ),
        (
            ["loss.type=[sigmoid, sft]", "loss.weights=[0, 0]"],
            "loss.weights is [0, 0]: every weight is 0, so the objective is 0 and nothing trains; give a type a "
            "weight above 0",
        ),
        (
            ["loss.type=[hinge, ipo]", "loss.label_smoothing=0.1"],
            "loss.label_smoothing is 0.1, but [hinge, ipo] has none; set it to 0, or use a loss.type that takes it "
            "(sigmoid, robust, simpo, exo_pair, cpo, alphapo, aot, aot_unpaired)",
        ),
        (
            ["loss.type=exo_pair"],
            "loss.label_smoothing is 0.0; exo_pair allows (0, 0.5); set it inside that range",
        ),
        (
            ["loss.type=[sigmoid, exo_pair]", "loss.label_smoothing=0.7"],
            "loss.label_smoothing is 0.7; sigmoid allows [0, 0.5), exo_pair allows (0, 0.5): it is the chance that "
            "a pair's labels are flipped, so at 0.5 chosen and rejected weigh the same and the gradient vanishes at "
            "parity (the policy still the reference), and above 0.5 every preference is flipped; set it below 0.5 "
            "(robust DPO's paper suggests 0.1)",
        ),
        (
            ["loss.discopop_tau=0.2"],
            "loss.discopop_tau is 0.2, but loss.type sigmoid does not read it (only discopop reads it); drop it "
            "(default 0.05), or list discopop in loss.type",
        ),
        (
            ["loss.type=[sigmoid, hinge]", "loss.target_margin=1.0"],
            "loss.target_margin is 1.0, but loss.type [sigmoid, hinge] does not read it (only simpo, alphapo "
            "read it); drop it (default 0.5), or list one of them (simpo, alphapo) in loss.type",
        ),
        (
            ["loss.type=[sigmoid, bco_pair]", "loss.f_divergence_type=js_divergence"],
            "loss.f_divergence_type is js_divergence, but bco_pair reads the log-ratios themselves and has no "
            "f-divergence form (TRL 1.16 refuses it too); set loss.f_divergence_type: reverse_kl, or use types "
            "that take it (sigmoid, ipo, hinge, robust, exo_pair, discopop, sigmoid_norm)",
        ),
        (
            ["loss.type=sft", "reference.mode=none", "loss.f_divergence_type=forward_kl"],
            "loss.f_divergence_type is forward_kl, but loss.type sft reads no log-ratio, so it would change "
            "nothing; set loss.f_divergence_type: reverse_kl, or list a type that takes it (sigmoid, ipo, hinge, "
            "robust, exo_pair, discopop, sigmoid_norm)",
        ),
        (
            ["loss.f_divergence_type=js_divergence", "loss.f_alpha_divergence_coef=0.3"],
            "loss.f_alpha_divergence_coef is 0.3, but loss.f_divergence_type is js_divergence: only "
            "alpha_divergence reads it; drop it (default 0.5), or set loss.f_divergence_type: alpha_divergence",
        ),
        (
            ["loss.type=[sigmoid, sft]", "loss.nll_weight=0.5"],
            "loss.type lists sft, the NLL on chosen completions (weighted by its loss.weights entry), and "
            "loss.nll_weight is 0.5, the same term; say it one way: set loss.nll_weight: 0, or drop sft from "
            "loss.type",
        ),
        (
            ["loss.type=[simpo, sigmoid]", "reference.mode=none"],
            "loss.type [simpo, sigmoid] needs a reference; set reference.mode: live or precomputed, or use a "
            "reference-free loss.type (simpo, sft, cpo, alphapo, orpo, cpo_hinge, cpo_ipo)",
        ),
    ],
    ids=[
        "unknown-in-list",
        "empty-list",
        "negative-weight",
        "twice",
        "weights-without-list",
        "weights-length",
        "all-zero",
        "smoothing-none-listed",
        "exo-needs-smoothing",
        "smoothing-every-range",
        "discopop-tau",
        "target-margin",
        "f-divergence-refused",
        "f-divergence-applies-to-none",
        "alpha-coef",
        "sft-and-nll-weight",
        "list-needs-reference",
    ],
)
def test_each_list_rule_refuses_its_case_by_name(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config({"data": {"path": "x"}}, overrides)
    assert str(info.value).startswith(message) if message.startswith(SCHEMA) else str(info.value) == message


@pytest.mark.parametrize(
    "overrides",
    [
        ["loss.type=[sigmoid, bco_pair, sft]", "loss.weights=[0.8, 0.2, 1.0]"],
        ["loss.type=[sigmoid, sft]", "loss.weights=[1, 0]"],
        ["loss.type=[simpo, sft]", "reference.mode=none", "loss.target_margin=1.0"],
        ["loss.type=[discopop, hinge]", "loss.discopop_tau=0.5"],
        ["loss.type=exo_pair", "loss.label_smoothing=1e-3"],
        ["loss.type=[sigmoid, robust]", "loss.label_smoothing=0.49"],
        ["loss.type=[sigmoid, hinge]", "loss.label_smoothing=0.2"],
        [
            "loss.type=[sigmoid_norm, sft]",
            "loss.f_divergence_type=alpha_divergence",
            "loss.f_alpha_divergence_coef=0.2",
        ],
        ["loss.type=sft", "reference.mode=none"],
    ],
)
def test_the_edges_of_each_list_rule_load(overrides):
    load_config({}, overrides)


def test_a_list_built_in_code_is_checked_too():
    """A TrainConfig that never went through the schema: a bad name by its place, a NaN or negative weight,
    an unknown f-divergence, each named."""
    from dpo_train.config.rules import config_problems
    from dpo_train.config.sections import TrainConfig
    from dpo_train.step.loss import LOSSES, LossConfig

    def problems(**loss):
        return config_problems(TrainConfig(loss=LossConfig(**loss)), for_run=False)

    assert problems(type=["sigmoid", "kto"]) == [
        f"loss.type[1] is 'kto'; allowed: {', '.join(LOSSES)}; set loss.type[1] to one of them "
        '(docs/objective.md, "The loss family")'
    ]
    assert problems(type=[]) == [
        'loss.type is an empty list; name one loss type or more (docs/objective.md, "The loss family")'
    ]
    assert problems(type=["sigmoid", "hinge"], weights=[float("nan"), -1.0]) == [
        "loss.weights is [nan, -1.0]; each weight is a finite number >= 0, and [nan, -1.0] are not; fix them"
    ]
    assert problems(f_divergence_type="kl") == [
        "loss.f_divergence_type is 'kl'; allowed: reverse_kl, forward_kl, js_divergence, alpha_divergence; set it "
        "to one of them"
    ]


# -- the run identity: the objective a checkpoint records --


def test_a_default_objective_is_what_checkpoints_recorded_before_the_new_loss_keys():
    """A checkpoint written before loss.weights, discopop_tau and the f-divergence keys existed must still
    resume: with those keys at their defaults the objective is the one main's identity.py wrote (this dict
    is its output for these configs); each key joins it only when set."""
    from dpo_train.checkpoint.identity import _objective
    from dpo_train.config.sections import TrainConfig
    from dpo_train.step.loss import LossConfig

    before = {"type": "sigmoid", "beta": 0.1, "label_smoothing": 0.0, "nll_weight": 0.0, "average_log_prob": False}
    assert _objective(TrainConfig(), 0.0) == {**before, "target_margin": 0.5}
    simpo = LossConfig(type="simpo", beta=2.0, target_margin=0.3, average_log_prob=True)
    assert _objective(TrainConfig(loss=simpo), 0.001) == {
        **before,
        "type": "simpo",
        "beta": 2.0,
        "average_log_prob": True,
        "target_margin": 0.3,
        "router_aux_coef": 0.001,
    }
    set_ = LossConfig(
        type=["discopop", "sft"],
        weights=[1.0, 0.5],
        discopop_tau=0.1,
        f_divergence_type="alpha_divergence",
        f_alpha_divergence_coef=0.2,
    )
    assert _objective(TrainConfig(loss=set_), 0.0) == {
        **before,
        "type": ["discopop", "sft"],
        "target_margin": 0.5,
        "weights": [1.0, 0.5],
        "discopop_tau": 0.1,
        "f_divergence_type": "alpha_divergence",
        "f_alpha_divergence_coef": 0.2,
    }


# -- the reference-free methods' rules --


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["loss.type=simpo", "reference.mode=none", "loss.alpha=0.25"],
            "loss.alpha is 0.25, but loss.type simpo does not read it (only cpo, alphapo, cpo_hinge, cpo_ipo read "
            "it); drop it (default 0.0), or list one of them (cpo, alphapo, cpo_hinge, cpo_ipo) in loss.type",
        ),
        (
            ["loss.type=cpo", "reference.mode=none"],
            "loss.type cpo: cpo's objective adds the NLL on chosen completions (TRL's cpo_alpha, 1.0 by default, "
            "for cpo; weight 1 for orpo), and no key weighs it; say its weight: loss.nll_weight: 1.0, or list sft "
            "in loss.type with its weight in loss.weights (0 to leave it out)",
        ),
        (
            ["loss.type=[orpo, bco_pair]"],
            "loss.type [orpo, bco_pair]: orpo's objective adds the NLL on chosen completions (TRL's cpo_alpha, "
            "1.0 by default, for cpo; weight 1 for orpo), and no key weighs it; say its weight: loss.nll_weight: "
            "1.0, or list sft in loss.type with its weight in loss.weights (0 to leave it out)",
        ),
    ],
    ids=["alpha-without-alphapo", "cpo-without-nll", "orpo-without-nll"],
)
def test_each_reference_free_rule_refuses_its_case_by_name(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config({"data": {"path": "x"}}, overrides)
    assert str(info.value) == message


def test_the_reference_free_methods_load_with_reference_mode_none():
    """TRL's CPO (BC weight said either way, or 0 by listing sft at 0), AlphaPO with its alpha, ORPO with its NLL."""
    for overrides in (
        ["loss.type=[cpo, sft]", "loss.weights=[1.0, 0.0]"],
        ["loss.type=cpo", "loss.nll_weight=1.0"],
        ["loss.type=alphapo", "loss.alpha=0.25", "loss.target_margin=0.3", "loss.label_smoothing=0.1"],
        ["loss.type=[orpo, sft]", "loss.beta=0.2"],
    ):
        config = load_config({"data": {"path": "x"}}, [*overrides, "reference.mode=none"])
        assert config.loss.needs_reference is False


# -- LD-DPO (loss.ld_alpha) and WPO (loss.use_weighting) --


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["loss.ld_alpha=1.5"],
            SCHEMA + "loss/ld_alpha: 1.5 is greater than the maximum of 1; allowed: a number in [0, 1]",
        ),
        (["loss.ld_alpha=-0.1"], SCHEMA + "loss/ld_alpha: -0.1 is less than the minimum of 0"),
        (["loss.use_weighting=1"], SCHEMA + "loss/use_weighting: 1 is not of type 'boolean'"),
        (
            ["loss.ld_alpha=0.5", "reference.mode=precomputed", "reference.path=sidecar"],
            "loss.ld_alpha is 0.5, but reference.mode is precomputed: a sidecar holds the reference's plain summed "
            "log-probs, not LD-DPO's; set reference.mode: live (the reference then gets the same weighting), or "
            "loss.ld_alpha: null",
        ),
        (
            ["loss.use_weighting=true", "loss.type=[sigmoid, sft]"],
            "loss.use_weighting is true and loss.type lists sft: TRL multiplies its SFT term by each pair's WPO "
            "weight, and here it is the step's NLL per chosen token, which no pair's weight scales; drop sft from "
            "loss.type (loss.nll_weight gives the same term, unweighted), or set loss.use_weighting: false",
        ),
    ],
    ids=[
        "ld-above-1",
        "ld-below-0",
        "weighting-not-bool",
        "ld-sidecar",
        "weighting-sft",
    ],
)
def test_each_per_token_rule_refuses_its_case_by_name(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config({"data": {"path": "x"}}, overrides)
    assert str(info.value).startswith(message) if message.startswith(SCHEMA) else str(info.value) == message


@pytest.mark.parametrize(
    "overrides",
    [
        ["loss.ld_alpha=0"],
        ["loss.ld_alpha=1"],
        ["loss.ld_alpha=null"],
        ["loss.ld_alpha=0.5", "loss.use_weighting=true", "loss.type=[sigmoid, bco_pair]"],
        ["loss.use_weighting=true", "loss.nll_weight=0.5"],
        ["loss.ld_alpha=0.5", "loss.type=simpo", "reference.mode=precomputed", "reference.path=sidecar"],
        ["loss.use_weighting=true", "reference.mode=precomputed", "reference.path=sidecar"],
        ["loss.ld_alpha=0", "loss.use_weighting=true", "distributed.sequence_parallel={ulysses: 2, context: 2}"],
    ],
    ids=[
        "ld-0",
        "ld-1",
        "ld-null",
        "both-list",
        "weighting-nll",
        "ld-reference-free",
        "weighting-sidecar",
        "sequence-parallel",
    ],
)
def test_the_edges_of_each_per_token_rule_load(overrides):
    """A reference-free type reads no sidecar, so ld_alpha passes with one configured; WPO's weights are the
    policy's alone, so a sidecar is fine with them; both run under sequence parallelism
    (tests/train/logps/test_logps.py checks them on a 2-rank mesh)."""
    load_config({}, overrides)


def test_per_token_keys_built_in_code_are_checked_too():
    from dpo_train.config.rules import config_problems
    from dpo_train.config.sections import TrainConfig
    from dpo_train.step.loss import LossConfig

    def problems(**loss):
        return config_problems(TrainConfig(loss=LossConfig(**loss)), for_run=False)

    assert problems(ld_alpha=float("nan")) == [
        "loss.ld_alpha is nan; allowed: null (plain sums) or a number in [0, 1] (TRL's ld_alpha); set it so"
    ]
    assert problems(ld_alpha=True) == [
        "loss.ld_alpha is True; allowed: null (plain sums) or a number in [0, 1] (TRL's ld_alpha); set it so"
    ]
    assert problems(use_weighting="yes") == [
        "loss.use_weighting is 'yes'; allowed: true or false; set it to one of them"
    ]
    assert problems(ld_alpha=0.0, use_weighting=True) == []


def test_the_per_token_keys_join_the_objective_only_when_set():
    """Existing runs' identity stays the same: ld_alpha and use_weighting at their defaults are not recorded."""
    from dpo_train.checkpoint.identity import _objective
    from dpo_train.config.sections import TrainConfig
    from dpo_train.step.loss import LossConfig

    plain = _objective(TrainConfig(), 0.0)
    assert "ld_alpha" not in plain and "use_weighting" not in plain
    both = _objective(TrainConfig(loss=LossConfig(ld_alpha=0.0, use_weighting=True)), 0.0)
    assert both == {**plain, "ld_alpha": 0.0, "use_weighting": True}


# -- the sorted types (AOT) --


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            ["loss.type=aot", "loss.average_log_prob=true"],
            "loss.average_log_prob is true, but loss.type lists aot, which sorts the summed log-ratios over the "
            "step as TRL 1.16 does; set loss.average_log_prob: false",
        ),
        (
            ["loss.type=[sigmoid, aot_unpaired]", "loss.use_weighting=true"],
            "loss.use_weighting is true, but loss.type lists aot_unpaired: each of its sorted terms pairs two "
            "pairs' log-ratios, and no one pair's WPO weight scales it (TRL 1.16 refuses this too); set "
            "loss.use_weighting: false",
        ),
        (
            ["loss.type=aot", "loss.f_divergence_type=js_divergence"],
            "loss.f_divergence_type is js_divergence, but aot reads the log-ratios themselves",
        ),
        (["loss.type=aot_unpaired", "loss.label_smoothing=0.6"], "loss.label_smoothing is 0.6"),
    ],
    ids=["means", "weighting", "f-divergence", "smoothing"],
)
def test_each_sorted_rule_refuses_its_case_by_name(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config({"data": {"path": "x"}}, overrides)
    assert str(info.value).startswith(message)


@pytest.mark.parametrize(
    "overrides",
    [
        ["loss.type=aot", "loss.label_smoothing=0.49"],
        ["loss.type=[aot, aot_unpaired, sft]", "loss.ld_alpha=0.5", "reference.mode=live"],
        ["loss.type=aot", "reference.mode=precomputed", "reference.path=sidecar"],
        ["loss.type=aot_unpaired", "distributed.sequence_parallel={ulysses: 2}"],
    ],
    ids=["smoothing-edge", "list-ld", "sidecar", "sequence-parallel"],
)
def test_the_edges_of_each_sorted_rule_load(overrides):
    """AOT reads the reference's plain (or LD) sums like any type, from a sidecar too, and its partners are
    found over sequence-parallel groups (tests/train/step/test_step_sort.py)."""
    load_config({}, overrides)


# -- TR-DPO (reference.sync_ref_model) --

SYNC = "reference.sync_ref_model=true"
KEEP = "or set reference.sync_ref_model: false"


@pytest.mark.parametrize(
    "overrides, message",
    [
        (
            [SYNC, "reference.mode=precomputed", "reference.path=sidecar"],
            "reference.sync_ref_model is true, but reference.mode is precomputed: the sidecar holds the log-probs "
            "of a fixed reference, which TR-DPO's moves would make stale (TRL 1.16 refuses it too); set "
            f"reference.mode: live, {KEEP}",
        ),
        (
            [SYNC, "reference.mode=none", "loss.type=simpo"],
            "reference.sync_ref_model is true, but reference.mode is none: there is no reference to move; use a "
            f"loss.type that reads a reference with reference.mode: live, {KEEP}",
        ),
        (
            [SYNC, "loss.type=[orpo, sft]"],
            "reference.sync_ref_model is true, but loss.type [orpo, sft] is reference-free: there is no reference "
            f"to move; use a loss.type that reads a reference with reference.mode: live, {KEEP}",
        ),
        (
            [SYNC, "model.lora={r: 2}"],
            "reference.sync_ref_model is true, but model.lora is set: the LoRA reference is the policy with its "
            "adapters disabled, so there is no separate copy to move (TRL 1.16 refuses PEFT with it too); drop "
            f"model.lora (full fine-tuning), {KEEP}",
        ),
        (
            ["reference.ref_model_mixup_alpha=0.5"],
            "reference.ref_model_mixup_alpha is 0.5, but reference.sync_ref_model is false: only TR-DPO reads it; "
            "drop it (default 0.6), or set reference.sync_ref_model: true",
        ),
        (
            ["reference.ref_model_sync_steps=64"],
            "reference.ref_model_sync_steps is 64, but reference.sync_ref_model is false: only TR-DPO reads it; "
            "drop it (default 512), or set reference.sync_ref_model: true",
        ),
        (
            [SYNC, "reference.ref_model_mixup_alpha=1.5"],
            SCHEMA + "reference/ref_model_mixup_alpha: 1.5 is greater than the maximum of 1; allowed: a number in "
            "[0, 1]" + BOUNDS,
        ),
        (
            [SYNC, "reference.ref_model_mixup_alpha=-0.1"],
            SCHEMA + "reference/ref_model_mixup_alpha: -0.1 is less than the minimum of 0; allowed: a number in "
            "[0, 1]" + BOUNDS,
        ),
        (
            [SYNC, "reference.ref_model_sync_steps=0"],
            SCHEMA + "reference/ref_model_sync_steps: 0 is less than the minimum of 1; allowed: an integer in "
            "[1, 1_000_000_000]" + BOUNDS,
        ),
        (["reference.sync_ref_model=1"], SCHEMA + "reference/sync_ref_model: 1 is not of type 'boolean'"),
    ],
    ids=[
        "precomputed",
        "mode-none",
        "reference-free",
        "lora",
        "alpha-without-sync",
        "steps-without-sync",
        "alpha-above-1",
        "alpha-below-0",
        "steps-0",
        "sync-not-bool",
    ],
)
def test_each_tr_dpo_rule_refuses_its_case_by_name(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config({"data": {"path": "x"}}, overrides)
    assert str(info.value) == message


@pytest.mark.parametrize(
    "overrides",
    [
        [SYNC],
        [SYNC, "reference.ref_model_mixup_alpha=0", "reference.ref_model_sync_steps=1"],
        [SYNC, "reference.ref_model_mixup_alpha=1", "loss.ld_alpha=0.5", "eval.path=held-out"],
        [SYNC, "loss.type=[sigmoid, sft]", "loss.weights=[1.0, 0.1]", "distributed.strategy=ddp"],
        ["reference.sync_ref_model=false", "reference.ref_model_mixup_alpha=0.6", "reference.ref_model_sync_steps=512"],
    ],
    ids=["defaults", "alpha-0-steps-1", "alpha-1-ld-eval", "list-ddp", "off-at-defaults"],
)
def test_the_edges_of_each_tr_dpo_rule_load(overrides):
    """A move with alpha 0 leaves the reference as it is and alpha 1 makes it the policy: both are TRL's range;
    a list with a type that reads a reference moves it too."""
    load_config({}, overrides)


def test_tr_dpo_keys_built_in_code_are_checked_too():
    from dpo_train.config.rules import config_problems
    from dpo_train.config.sections import ReferenceConfig, TrainConfig

    def problems(**reference):
        return config_problems(TrainConfig(reference=ReferenceConfig(**reference)), for_run=False)

    assert problems(sync_ref_model=True, ref_model_mixup_alpha=float("nan"), ref_model_sync_steps=2.5) == [
        "reference.ref_model_mixup_alpha is nan; allowed: a number in [0, 1] (the policy's share in each move); "
        "set it so",
        "reference.ref_model_sync_steps is 2.5; allowed: an integer in [1, 1_000_000_000] (optimizer steps between "
        "moves); set it so",
    ]
    assert problems(sync_ref_model="yes", ref_model_mixup_alpha=True, ref_model_sync_steps=0) == [
        "reference.sync_ref_model is 'yes'; allowed: true or false; set it to one of them",
        "reference.ref_model_mixup_alpha is True; allowed: a number in [0, 1] (the policy's share in each move); "
        "set it so",
        "reference.ref_model_sync_steps is 0; allowed: an integer in [1, 1_000_000_000] (optimizer steps between "
        "moves); set it so",
    ]
    assert problems(sync_ref_model=True, ref_model_mixup_alpha=0, ref_model_sync_steps=1) == []


def test_the_tr_dpo_keys_join_the_reference_identity_only_when_on():
    """A run without TR-DPO records the reference as main's identity.py did before the keys existed (this dict),
    so its checkpoints still resume; with it, the three keys are recorded and a resume with others is refused."""
    from dpo_train.checkpoint.identity import _reference
    from dpo_train.config.sections import ReferenceConfig, TrainConfig

    before = {"mode": "live", "weights_fingerprint": "sha256:w", "sidecar_table": None}
    assert _reference(TrainConfig(), "sha256:w", None) == before
    on = ReferenceConfig(sync_ref_model=True, ref_model_mixup_alpha=0.5, ref_model_sync_steps=8)
    assert _reference(TrainConfig(reference=on), "sha256:w", None) == {
        **before,
        "sync_ref_model": True,
        "ref_model_mixup_alpha": 0.5,
        "ref_model_sync_steps": 8,
    }


def test_one_table_of_schedules_for_the_schema_the_trl_translation_and_the_docs():
    """`dpo_train.step.optim.SCHEDULES` is the schedules' one table: the schema's enum is its keys, the TRL
    translation maps onto them, and the config's docstring names each."""
    import inspect
    import json
    from pathlib import Path

    from dpo_train.config.sections import OptimConfig
    from dpo_train.config.trl_convert import SCHEDULERS
    from dpo_train.step.optim import SCHEDULES

    schema = json.loads((Path(__file__).parents[3] / "schemas" / "train-config.schema.json").read_text())
    assert schema["properties"]["optim"]["properties"]["scheduler"]["enum"] == list(SCHEDULES)
    assert set(SCHEDULERS.values()) <= set(SCHEDULES)
    assert OptimConfig().scheduler in SCHEDULES
    assert all(name in inspect.getsource(OptimConfig) for name in SCHEDULES)
