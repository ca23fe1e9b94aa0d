"""TRL's names: every DPOConfig field mapped or refused by name, translations load with TRL's values, the
"did you mean" of a normal config answers TRL names, `dpo-train --from-trl`, and the docs table is the table."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from dpo_train.config.loading import load_config
from dpo_train.config.trl import translate
from dpo_train.config.trl_convert import KEEP_ALL
from dpo_train.config.trl_table import TABLE, markdown_table
from dpo_train.errors import ConfigError
from tests.harness import cli_argv, run_process

DOCS = Path(__file__).resolve().parents[2] / "docs" / "train-config.md"

NOTES = "notes"

SAMPLES = {
    "model_init_kwargs": ({"model_init_kwargs": {"attn_implementation": "sdpa"}}, "model.attention", "sdpa"),
    "router_aux_loss_coef": ({"router_aux_loss_coef": 0.01}, "loss.router_aux_coef", 0.01),
    "precompute_ref_log_probs": (
        {"precompute_ref_log_probs": True, "output_dir": "/r/run"},
        "reference.path",
        "/r/run-reference",
    ),
    "loss_type": ({"loss_type": ["ipo"]}, "loss.type", "ipo"),
    "sync_ref_model": ({"sync_ref_model": True}, "reference.sync_ref_model", True),
    "ref_model_mixup_alpha": (
        {"sync_ref_model": True, "ref_model_mixup_alpha": 0.9},
        "reference.ref_model_mixup_alpha",
        0.9,
    ),
    "ref_model_sync_steps": (
        {"sync_ref_model": True, "ref_model_sync_steps": 64},
        "reference.ref_model_sync_steps",
        64,
    ),
    "loss_weights": ({"loss_type": ["sigmoid", "sft"], "loss_weights": [1.0, 0.5]}, "loss.weights", [1.0, 0.5]),
    "ld_alpha": ({"ld_alpha": 0.5}, "loss.ld_alpha", 0.5),
    "f_divergence_type": ({"f_divergence_type": "js_divergence"}, "loss.f_divergence_type", "js_divergence"),
    "f_alpha_divergence_coef": (
        {"f_divergence_type": "alpha_divergence", "f_alpha_divergence_coef": 0.3},
        "loss.f_alpha_divergence_coef",
        0.3,
    ),
    "label_smoothing": ({"loss_type": "robust", "label_smoothing": 0.2}, "loss.label_smoothing", 0.2),
    "beta": ({"beta": 0.3}, "loss.beta", 0.3),
    "use_weighting": ({"use_weighting": True}, "loss.use_weighting", True),
    "discopop_tau": ({"loss_type": "discopop", "discopop_tau": 0.1}, "loss.discopop_tau", 0.1),
    "output_dir": ({"output_dir": "/r/run"}, "train.output_dir", "/r/run"),
    "per_device_train_batch_size": ({"per_device_train_batch_size": 3}, "data.pairs_per_step", 3),
    "gradient_accumulation_steps": ({"gradient_accumulation_steps": 5}, "data.pairs_per_step", 40),
    "num_train_epochs": ({"num_train_epochs": 2}, "train.epochs", 2),
    "max_steps": ({"max_steps": 30}, "train.max_steps", 30),
    "learning_rate": ({"learning_rate": 3e-5}, "optim.lr", 3e-5),
    "lr_scheduler_type": ({"lr_scheduler_type": "cosine"}, "optim.scheduler", "cosine"),
    "warmup_steps": ({"warmup_steps": 7}, "optim.warmup_steps", 7),
    "warmup_ratio": ({"max_steps": 40, "warmup_ratio": 0.1}, "optim.warmup_steps", 4),
    "optim": ({"optim": "sgd"}, "optim.name", "sgd"),
    "weight_decay": ({"weight_decay": 0.01}, "optim.weight_decay", 0.01),
    "adam_beta1": ({"adam_beta1": 0.8}, "optim.betas", [0.8, 0.999]),
    "adam_beta2": ({"adam_beta2": 0.95}, "optim.betas", [0.9, 0.95]),
    "adam_epsilon": ({"adam_epsilon": 1e-6}, "optim.eps", 1e-6),
    "max_grad_norm": ({"max_grad_norm": 0.5}, "optim.max_grad_norm", 0.5),
    "seed": ({"seed": 7}, "data.seed", 7),
    "data_seed": ({"seed": 7, "data_seed": 9}, "data.seed", 9),
    "logging_strategy": ({"logging_strategy": "steps", "logging_steps": 4}, "train.log_every", 4),
    "logging_steps": ({"logging_steps": 3}, "train.log_every", 3),
    "save_strategy": ({"save_strategy": "no", "save_steps": 20}, "train.save_every", 0),
    "save_steps": ({"save_steps": 25}, "train.save_every", 25),
    "save_total_limit": ({"save_total_limit": 2}, "train.keep_last", 2),
    "resume_from_checkpoint": ({"resume_from_checkpoint": "/r/ck"}, "train.resume", "/r/ck"),
    "bf16": ({"bf16": False}, "train.precision", "fp32"),
    "fp16": ({"fp16": False, "bf16": True}, "train.precision", "bf16"),
    "gradient_checkpointing": ({"gradient_checkpointing": False}, "train.activation_checkpointing", False),
    "report_to": ({"report_to": ["tensorboard"]}, "train.report_to", ["tensorboard"]),
    "eval_strategy": ({"eval_strategy": "steps", "eval_steps": 5}, "eval.every", 5),
    "eval_steps": ({"eval_strategy": "steps", "eval_steps": 6}, "eval.every", 6),
    "dataloader_num_workers": ({"dataloader_num_workers": 2}, "data.num_workers", 2),
    "use_cpu": ({"use_cpu": True}, "distributed.device", "cpu"),
    "rpo_alpha": ({"rpo_alpha": 0.5}, "loss.nll_weight", 0.5),
    "model_name_or_path": ({"model_name_or_path": "/models/x"}, "model.path", "/models/x"),
    "attn_implementation": ({"attn_implementation": "eager"}, "model.attention", "eager"),
    "use_peft": (
        {"use_peft": True, "lora_target_modules": ["q_proj"]},
        "model.lora",
        {"r": 16, "alpha": 32, "dropout": 0.05, "target_modules": ["q_proj"]},
    ),
    "lora_r": ({"use_peft": True, "lora_target_modules": ["q_proj"], "lora_r": 4}, "model.lora.r", 4),
    "lora_alpha": ({"use_peft": True, "lora_target_modules": ["q_proj"], "lora_alpha": 8}, "model.lora.alpha", 8),
    "lora_dropout": (
        {"use_peft": True, "lora_target_modules": ["q_proj"], "lora_dropout": 0.1},
        "model.lora.dropout",
        0.1,
    ),
    "lora_target_modules": (
        {"use_peft": True, "lora_target_modules": "all-linear"},
        "model.lora.target_modules",
        "all-linear",
    ),
    "dataset_name": ({"dataset_name": "BUILT"}, "data.path", "BUILT"),
    "dtype": ({"dtype": "bfloat16"}, "train.precision", "bf16"),
    "torch_dtype": ({"torch_dtype": "bfloat16"}, "train.precision", "bf16"),
    "dataset_num_proc": ({"dataset_num_proc": 12}, NOTES, "--num-proc 12"),
    "max_length": ({"max_length": 512}, NOTES, "--out /d/train --max-length 512"),
    "truncation_mode": ({"truncation_mode": "keep_end"}, NOTES, "--max-length 1024 --overlength truncate-prompt`"),
    "max_prompt_length": ({"max_prompt_length": 256}, NOTES, "--max-length 1024 --overlength truncate-prompt`"),
    "per_device_eval_batch_size": (
        {"per_device_eval_batch_size": 4},
        NOTES,
        "accepted, changing nothing here: per_device_eval_batch_size",
    ),
    "push_to_hub": (
        {"push_to_hub": True, "output_dir": "/r/run"},
        NOTES,
        "`dpo-state push /r/run/final NAMESPACE/run`",
    ),
    "hub_model_id": (
        {"push_to_hub": True, "hub_model_id": "me/x"},
        NOTES,
        "`dpo-state push trainer_output/final me/x`",
    ),
    "hub_private_repo": (
        {"push_to_hub": True, "hub_model_id": "me/x", "hub_private_repo": True},
        NOTES,
        "final me/x --private`",
    ),
    "dataset_train_split": (
        {"dataset_name": "org/prefs", "dataset_train_split": "train_prefs"},
        NOTES,
        "`dpo-data build 'hf://datasets/org/prefs/data/train_prefs-*' --tokenizer MODEL_DIR --out /d/train",
    ),
    "dataset_mixture": (
        {"dataset_mixture": {"datasets": [{"id": "org/a", "split": "s"}, {"id": "/x/b.jsonl"}]}},
        NOTES,
        "`dpo-data build 'hf://datasets/org/a/data/s-*' /x/b.jsonl --tokenizer MODEL_DIR",
    ),
    "datasets": (
        {"datasets": [{"path": "org/a", "split": "s"}, {"path": "json", "data_files": ["/x/b.jsonl"]}]},
        NOTES,
        "`dpo-data build 'hf://datasets/org/a/data/s-*' /x/b.jsonl --tokenizer MODEL_DIR",
    ),
    "test_split_size": ({"test_split_size": 0.1}, NOTES, "test_split_size 0.1 holds rows of datasets out"),
    "run_name": ({"run_name": "my run"}, NOTES, "`WANDB_NAME='my run' dpo-train CONFIG`"),
}
"""Per mapped TRL field: a TRL config setting it, the key here, and the value that key must then hold (or, NOTES:
a text of the notes, with --set data.path=/d/train: the printed build and push commands)."""

COMMON_TRAINING_ARGUMENTS = (
    "learning_rate per_device_train_batch_size gradient_accumulation_steps num_train_epochs max_steps warmup_steps "
    "lr_scheduler_type weight_decay adam_beta1 adam_beta2 adam_epsilon max_grad_norm seed save_steps save_total_limit "
    "logging_steps eval_steps output_dir bf16 fp16 gradient_checkpointing report_to resume_from_checkpoint optim "
    "data_seed save_strategy logging_strategy eval_strategy dataloader_num_workers"
).split()


def _value(config, key: str):
    """The value at section.key[.sub] of a loaded config."""
    section, *names = key.split(".")
    value = getattr(getattr(config, section), names[0])
    for name in names[1:]:
        value = value[name]
    return value


def _built(tmp_path: Path) -> str:
    """A directory that looks like a built dataset to the translator (it holds manifest.json)."""
    (tmp_path / "built").mkdir()
    (tmp_path / "built" / "manifest.json").write_text("{}")
    return str(tmp_path / "built")


def test_every_field_of_trls_dpoconfig_is_mapped_or_refused_and_the_common_training_arguments_too():
    trl = pytest.importorskip("trl")
    from transformers import TrainingArguments

    inherited = {f.name for f in dataclasses.fields(TrainingArguments)}
    own = [f.name for f in dataclasses.fields(trl.DPOConfig) if f.name not in inherited]
    assert len(own) == 25  # TRL 1.16's own fields: a new TRL field must get a row
    assert [name for name in own + COMMON_TRAINING_ARGUMENTS if name not in TABLE] == []
    script = [f.name for c in (trl.ModelConfig, trl.ScriptArguments) for f in dataclasses.fields(c)]
    assert [name for name in script if name not in TABLE] == []


def test_each_rows_trl_default_is_trls_own():
    trl = pytest.importorskip("trl")
    defaults = {}
    for cls in (trl.DPOConfig, trl.ModelConfig, trl.ScriptArguments):
        for f in dataclasses.fields(cls):
            has = f.default is not dataclasses.MISSING
            defaults[f.name] = f.default if has else f.default_factory()
    filled = {name: row.default for name, row in TABLE.items() if row.convert and name in defaults}
    assert {name: defaults[name] for name in filled} == filled
    harmless = {name: row.harmless[0] for name, row in TABLE.items() if row.harmless and name in defaults}
    assert {name: defaults[name] for name in harmless if name != "padding_free"} == {
        name: value for name, value in harmless.items() if name != "padding_free"
    }


def test_every_mapped_field_translates_into_a_config_holding_trls_value(tmp_path):
    assert sorted(SAMPLES) == sorted(name for name, row in TABLE.items() if row.convert)
    built = _built(tmp_path)
    for name, (trl, key, expected) in SAMPLES.items():
        trl = {k: built if v == "BUILT" else v for k, v in trl.items()}
        if key == NOTES:
            assert expected in "\n".join(translate(trl, overrides=["data.path=/d/train"])[1]), name
            continue
        translated, _ = translate(trl, overrides=["eval.path=/e"] if key.startswith("eval.") else [])
        got = _value(load_config(translated), key)
        assert got == (built if expected == "BUILT" else expected), (name, key, got)


def test_omitted_fields_take_trls_defaults_and_the_global_batch_counts_every_process():
    translated, _ = translate({"per_device_train_batch_size": 2, "gradient_accumulation_steps": 4}, world=4)
    config = load_config(translated)
    assert config.data.pairs_per_step == 2 * 4 * 4 and config.data.batching == "pairs"
    assert (config.optim.lr, config.optim.scheduler, config.optim.name) == (1e-6, "linear", "adamw")
    assert (config.train.max_steps, config.train.epochs, config.train.seed, config.data.seed) == (None, 3, 42, 42)
    assert (config.train.log_every, config.train.save_every, config.train.keep_last) == (10, 500, KEEP_ALL)
    assert config.train.activation_checkpointing is True and config.train.output_dir == "trainer_output"
    assert config.train.precision == "auto" and config.loss.type == "sigmoid" and config.loss.beta == 0.1


def test_a_ratio_of_steps_converts_with_max_steps_and_is_refused_without():
    config = load_config(translate({"max_steps": 25, "warmup_steps": 0.1, "logging_steps": 0.2})[0])
    assert (config.optim.warmup_steps, config.train.log_every) == (3, 5)  # ceil(2.5), ceil(5.0): transformers'
    with pytest.raises(ConfigError, match=r"logging_steps is 0.2, a ratio of the run's steps, but max_steps is not"):
        translate({"logging_steps": 0.2})


def test_a_warmup_ratio_without_max_steps_is_resolved_from_the_planned_steps():
    """TRL pairs warmup_ratio with epochs: the ratio is kept (optim.warmup_ratio) and the run's warm-up is
    ceil(ratio x the steps the loader plans), transformers' rounding."""
    for trl in ({"warmup_ratio": 0.1}, {"warmup_steps": 0.1}, {"warmup_steps": 0, "warmup_ratio": 0.1}):
        config = load_config(translate(trl)[0])
        assert (config.optim.warmup_ratio, config.optim.warmup_steps, config.train.max_steps) == (0.1, 0, None)
        assert [config.optim.warmup_for(total) for total in (1, 10, 25, 2012)] == [1, 1, 3, 202]
    with pytest.raises(ConfigError, match=r"optim.warmup_steps is 5 and optim.warmup_ratio is 0.1: the warm-up is"):
        load_config({"optim": {"warmup_steps": 5, "warmup_ratio": 0.1}})


def test_every_field_without_a_counterpart_is_refused_by_name_in_one_error():
    refused = [name for name, row in TABLE.items() if row.convert is None]
    with pytest.raises(ConfigError) as caught:
        translate({name: 12345 for name in refused})
    lines = dict(zip(refused, str(caught.value).splitlines()[1:], strict=True))
    assert [line.split(" is 12345")[0] for line in lines.values()] == [f"  - {name}" for name in refused]
    for name, line in lines.items():  # a boolean field is read as TRL reads one first: 12345 is none
        flag = TABLE[name].read is not None
        assert "TRL reads a boolean" in line if flag else "no counterpart" in line and line.endswith("drop it")
    assert (
        "max_completion_length is 12345; this toolkit has no counterpart: a build option here: `dpo-data build "
        "--max-length N` (the dataset is tokenized once, before training) (a completion is never truncated here)"
        in (str(caught.value))
    )


def test_values_that_change_nothing_here_are_accepted_and_listed():
    _, notes = translate({"disable_dropout": True, "padding_free": True, "push_to_hub": False, "pad_token": None})
    assert notes[-1] == "accepted, changing nothing here: disable_dropout, padding_free, push_to_hub, pad_token"


def test_values_trl_runs_differently_are_refused_naming_the_fix():
    cases = {
        "fp16": ({"fp16": True}, "fp16 is true; this toolkit has no fp16"),
        "scheduler": ({"lr_scheduler_type": "polynomial"}, "lr_scheduler_type is 'polynomial'; here: linear, cosine"),
        "constant": (
            {"lr_scheduler_type": "constant", "warmup_steps": 10},
            "lr_scheduler_type is constant, which in transformers takes no warm-up",
        ),
        "smoothing": ({"label_smoothing": 0.1}, "TRL 1.16's sigmoid reads no label_smoothing"),
        "epochs": ({"num_train_epochs": 1.5}, "num_train_epochs is 1.5; here train.epochs counts whole epochs"),
        "report": ({"report_to": "mlflow"}, "report_to names mlflow; here: tensorboard, wandb (train.report_to)"),
        "peft": ({"use_peft": True}, "use_peft is true and lora_target_modules is not set"),
        "dtype": ({"model_init_kwargs": {"dtype": "bfloat16"}}, "model_init_kwargs has dtype bfloat16"),
        "dataset": (
            {"dataset_name": "trl-lib/ultrafeedback"},
            "build it with `dpo-data build 'hf://datasets/trl-lib/ultrafeedback/data/train-*' --tokenizer MODEL_DIR",
        ),
        "training_arguments": ({"hub_strategy": "end"}, "hub_strategy is 'end': a transformers TrainingArguments"),
        "torch_dtype": ({"torch_dtype": "float16"}, "torch_dtype is float16; this toolkit has no fp16"),
        "typo": ({"learnig_rate": 1e-5}, "learnig_rate is not a field of TRL 1.16's DPOConfig, TrainingArguments, "),
        "loss": ({"loss_type": "kto_pair"}, "loss_type names 'kto_pair'; here (TRL 1.16's names"),
    }
    for case, (trl, message) in cases.items():
        with pytest.raises(ConfigError) as caught:
            translate(trl)
        assert message in str(caught.value), case
    with pytest.raises(ConfigError, match="did you mean 'learning_rate'"):
        translate({"learnig_rate": 1e-5})


def test_a_dataset_name_is_superseded_by_a_data_path_override_and_the_overrides_apply():
    translated, notes = translate({"dataset_name": "trl-lib/ultrafeedback"}, overrides=["data.path=/d/train"])
    assert translated["data"]["path"] == "/d/train"
    assert not any("data.path is empty" in note for note in notes)


def test_a_trl_name_in_a_config_answers_with_its_key_here_not_a_lookalike():
    cases = {
        "learning_rate": (
            {"learning_rate": 1e-5},
            "unknown section 'learning_rate' (learning_rate is TRL's name; here it is optim.lr;",
        ),
        "save_steps": (
            {"train": {"save_steps": 5}},
            "unknown key train.save_steps (save_steps is TRL's name; here it is train.save_every;",
        ),
        "batch": (
            {"data": {"per_device_train_batch_size": 4}},
            "per_device_train_batch_size is TRL's name; here it is data.pairs_per_step;",
        ),
        "max_length": (
            {"max_length": 512},
            "max_length is TRL's name; here it is dpo-data build --max-length;",
        ),
    }
    for case, (raw, message) in cases.items():
        with pytest.raises(ConfigError) as caught:
            load_config(raw)
        assert message in str(caught.value), case
        assert "did you mean" not in str(caught.value), case


def test_dpo_train_from_trl_prints_a_config_dpo_train_loads(tmp_path, run_cli):
    from dpo_cli.train import main

    built = _built(tmp_path)
    trl = tmp_path / "trl.yaml"
    trl.write_text(
        "model_name_or_path: /models/smol\nlearning_rate: 5.0e-7\nper_device_train_batch_size: 2\n"
        f"gradient_accumulation_steps: 4\nmax_steps: 50\nbeta: 0.05\ndataset_name: {built}\npush_to_hub: false\n"
    )
    result = run_cli(main, "--from-trl", trl, "--nproc-per-node", "2", "--set", "train.output_dir=/r/x")
    assert result.exit_code == 0, result.stderr
    out = tmp_path / "train.yaml"
    out.write_text(result.stdout)
    config = load_config(out)
    assert (config.optim.lr, config.loss.beta, config.data.pairs_per_step) == (5e-7, 0.05, 16)
    assert (config.model.path, config.data.path, config.train.output_dir) == ("/models/smol", built, "/r/x")
    assert result.stderr == "note: accepted, changing nothing here: push_to_hub\n"
    trl.write_text("max_completion_length: 512\nfp16: true\n")
    result = run_cli(main, "--from-trl", trl)
    assert result.exit_code == 2 and result.stdout == ""
    assert (
        result.stderr.startswith("error: the TRL config does not translate")
        and "  - max_completion_length is 512" in result.stderr
    )
    result = run_cli(main, str(out), "--from-trl", trl)
    assert result.exit_code == 2 and "give CONFIG or --from-trl, not both" in result.stderr
    assert "--from-trl TRL.yaml" in run_cli(main, "--help").stdout


def test_the_docs_table_is_the_modules_table():
    table = DOCS.read_text().split("<!-- trl:start -->\n")[1].split("<!-- trl:end -->")[0]
    assert table == markdown_table()


# -- hostile values (issue 33): every value a TRL YAML can hold ends as a translation or one named error ----------

HOSTILE = ["false", "true", "maybe", "", float("nan"), float("inf"), float("-inf"), [True], ["a", 1], {"a": 1}]
HOSTILE += [None, 10**30, -5, -0.5, 2]
"""Quoted booleans, other text, NaN and infinities, lists and mappings where one value belongs, null, an integer
past every range, negatives, a number no boolean is."""

OUTSIDE_THE_TABLE = ["skip_memory_metrics", "hub_strategy", "learnig_rate"]
"""A TrainingArguments field with a boolean default, one with a text default, and a name TRL does not have."""


def _outcome(trl: dict, **kwargs) -> dict | str:
    """translate's config, or its ConfigError's message; any other exception fails the test as it is."""
    try:
        return translate(trl, **kwargs)[0]
    except ConfigError as error:
        return str(error)


def _with(name: str) -> dict:
    """What a field is read with (SAMPLES' other fields: use_peft for lora_r, ...), so that its own value is judged."""
    return {k: v for k, v in SAMPLES.get(name, ({},))[0].items() if k != name and v != "BUILT"}


@pytest.mark.parametrize("name", [*TABLE, *OUTSIDE_THE_TABLE])
def test_every_field_takes_every_hostile_value_to_a_translation_or_an_error_naming_it(name):
    for value in HOSTILE:
        out = _outcome(
            {**_with(name), name: value}, overrides=["data.path=/d"]
        )  # named by itself, not as a part of a key here (loss.beta)
        assert isinstance(out, dict) or re.search(rf"(?<![\w./]){name}(?!\w)", out), (value, out)


def test_every_field_that_converts_reads_its_value_by_its_kind_first():
    assert [name for name, row in TABLE.items() if row.convert and row.read is None] == []


def test_every_field_trl_types_as_a_boolean_reads_text_as_trls_parser_and_refuses_the_rest():
    trl = pytest.importorskip("trl")
    typed = {
        f.name: f.type for c in (trl.DPOConfig, trl.ModelConfig, trl.ScriptArguments) for f in dataclasses.fields(c)
    }
    booleans = [name for name in TABLE if typed.get(name) in (bool, "bool", bool | None, "bool | None")]
    assert len(booleans) >= 20 and "bf16" in booleans and "use_peft" in booleans
    for name in booleans:
        read = TABLE[name].read
        assert (read(name, "No"), read(name, "TRUE"), read(name, 0), read(name, True)) == (False, True, False, True)
        for value in ("maybe", 2, [True], 0.0):
            with pytest.raises(ConfigError, match=f"^{name} is .*; TRL reads a boolean here"):
                read(name, value)


@pytest.mark.parametrize(
    "text", ["yes", "YES", "True", "t", "Y", "1", "no", "No", "FALSE", "f", "N", "0", "maybe", "", "on", " true", "2"]
)
def test_a_boolean_as_text_means_what_transformers_string_to_bool_says(text):
    from argparse import ArgumentTypeError

    from transformers.hf_argparser import string_to_bool

    try:
        expected = string_to_bool(text)
    except ArgumentTypeError:  # on, off, a space: TRL's parser refuses them, and so does the translation
        assert "gradient_checkpointing is" in _outcome({"gradient_checkpointing": text})
        return
    config = load_config(translate({"gradient_checkpointing": text})[0])
    assert config.train.activation_checkpointing is expected


@pytest.mark.parametrize(
    "trl, key, expected",
    [
        ({"bf16": "false"}, "train.precision", "fp32"),
        ({"bf16": "FALSE"}, "train.precision", "fp32"),
        ({"bf16": "n"}, "train.precision", "fp32"),
        ({"bf16": 0}, "train.precision", "fp32"),
        ({"bf16": "true"}, "train.precision", "bf16"),
        ({"bf16": "Yes", "fp16": "false"}, "train.precision", "bf16"),
        ({"use_peft": "no", "lora_target_modules": ["q_proj"]}, "model.lora", None),
        ({"use_peft": "false", "lora_target_modules": ["q_proj"]}, "model.lora", None),
        (
            {"use_peft": "yes", "lora_target_modules": ["q_proj"], "lora_r": "4"},
            "model.lora",
            {"r": 4, "alpha": 32, "dropout": 0.05, "target_modules": ["q_proj"]},
        ),
        ({"precompute_ref_log_probs": "false", "output_dir": "/r/x"}, "reference.mode", "live"),
        ({"precompute_ref_log_probs": "t", "output_dir": "/r/x"}, "reference.path", "/r/x-reference"),
        ({"gradient_checkpointing": "false"}, "train.activation_checkpointing", False),
        ({"sync_ref_model": "false"}, "reference.sync_ref_model", False),
        ({"sync_ref_model": "TRUE"}, "reference.sync_ref_model", True),
        ({"use_weighting": "0"}, "loss.use_weighting", False),
        ({"use_cpu": "false"}, "distributed.device", "auto"),
        ({"use_cpu": "y"}, "distributed.device", "cpu"),
        ({"learning_rate": "1e-5"}, "optim.lr", 1e-5),
        ({"per_device_train_batch_size": "3", "gradient_accumulation_steps": 2.0}, "data.pairs_per_step", 6),
    ],
)
def test_quoted_booleans_and_numbers_translate_as_trl_reads_them(trl, key, expected):
    assert _value(load_config(translate(trl)[0]), key) == expected


def test_a_quoted_boolean_that_changes_nothing_is_accepted_as_its_value():
    trl = {"padding_free": "false", "disable_dropout": "True", "use_liger_kernel": "no", "push_to_hub": "false"}
    assert translate(trl)[1][-1] == f"accepted, changing nothing here: {', '.join(trl)}"
    assert "disable_dropout is False; this toolkit has no counterpart" in _outcome({"disable_dropout": "false"})


@pytest.mark.parametrize(
    "trl, message",
    [
        ({"bf16": "maybe"}, "bf16 is 'maybe'; TRL reads a boolean here: true or false, or (its parser's"),
        ({"bf16": 2}, "bf16 is 2; TRL reads a boolean here"),
        ({"bf16": [True]}, "bf16 is [True]; TRL reads a boolean here"),
        ({"use_peft": None}, "use_peft is None; TRL reads a boolean here"),
        ({"per_device_train_batch_size": float("nan")}, "per_device_train_batch_size is nan; here it must be a whole"),
        (
            {"max_steps": float("inf")},
            "max_steps is inf; here it must be a whole number in [-1, 1_000_000_000]; set max_steps to one",
        ),
        ({"warmup_ratio": float("inf")}, "warmup_ratio is inf; here it must be a finite number in [0, 1]"),
        ({"learning_rate": float("nan")}, "learning_rate is nan; here it must be a finite number in (0, 100]"),
        ({"learning_rate": "nan"}, "learning_rate is 'nan'; here it must be a finite number in (0, 100]"),
        ({"lr_scheduler_type": ["linear"]}, "lr_scheduler_type is ['linear']; here: linear, cosine, constant"),
        ({"optim": {"name": "sgd"}}, "optim is {'name': 'sgd'}; here: adamw_torch, adamw_torch_fused, adamw, sgd"),
        ({"loss_type": {"a": 1}}, "loss_type is {'a': 1}; give a name or a list of names (loss_type: [a, b])"),
        ({"report_to": 5}, "report_to is 5; give a name or a list of names"),
        ({"save_strategy": False}, "save_strategy is False (YAML reads a bare yes/no/on/off as a boolean: quote"),
        ({"model_init_kwargs": {1: "x"}}, "model_init_kwargs is {1: 'x'}; give a mapping of names to values"),
        ({1: 2}, "the key 1 is not a field name (YAML reads it as a number); TRL's fields are names"),
        ({True: 2}, "the key True is not a field name (YAML reads it as a boolean)"),
        ({None: 2}, "the key None is not a field name (YAML reads it as null)"),
        ({"warmup_ratio": 5, "max_steps": 10}, "warmup_ratio is 5; here it must be a finite number in [0, 1]; "),
    ],
)
def test_each_hostile_value_of_issue_33_is_one_named_error(trl, message):
    out = _outcome(trl)
    assert isinstance(out, str) and out.startswith("the TRL config does not translate") and message in out, out


def _named(error: str) -> list[str]:
    """The field (or the key that is not a name) each line of a translation error names, in its order."""
    return re.findall(r"^  - (?:the key )?(\S+)", error, re.MULTILINE)


def test_every_problem_is_named_at_once_in_the_files_order():
    out = _outcome({"bf16": "maybe", 1: 2, "optim": ["sgd"], "learning_rate": 1e-5, "max_steps": -3})
    assert _named(out) == [
        "bf16",
        "1",
        "optim",
        "max_steps",
    ]


def test_a_key_the_translated_config_refuses_names_the_trl_fields_behind_it_not_an_override():
    out = _outcome({"per_device_train_batch_size": 10**7, "gradient_accumulation_steps": 2})
    assert "data/pairs_per_step: 20000000 is greater than the maximum of 1000000" in out
    assert out.endswith(
        "(from the TRL config: data.pairs_per_step from per_device_train_batch_size 10000000, "
        "gradient_accumulation_steps 2)"
    )
    assert "from the TRL config" not in _outcome({"learning_rate": 1e-5}, overrides=["optim.lr=500"])


def test_a_warmup_ratio_is_a_share_of_the_steps_inside_0_and_1():
    warmup = [
        load_config(translate(trl)[0]).optim.warmup_steps
        for trl in (
            {"warmup_ratio": 1, "max_steps": 10},
            {"warmup_ratio": 0.25, "max_steps": 10},
            {"warmup_ratio": 0},
        )
    ]
    assert warmup == [10, 3, 0]  # today 1 was one step; 0 needs no max_steps
    for ratio in (5, 1.5, -0.1):
        assert f"warmup_ratio is {ratio}; here it must be a finite number in [0, 1]; warmup_ratio is a share of " in (
            _outcome({"warmup_ratio": ratio, "max_steps": 100})
        )


VANISHES = "at 0.5 chosen and rejected weigh the same and the gradient vanishes at parity"


@pytest.mark.parametrize("types", ["sigmoid", "aot", "aot_unpaired", "simpo", "robust", "exo_pair", "[cpo, sft]"])
@pytest.mark.parametrize("smoothing", [0.5, 0.7])
def test_label_smoothing_from_one_half_is_refused_naming_why(types, smoothing):
    overrides = [f"loss.type={types}", f"loss.label_smoothing={smoothing}", "reference.mode=live"]
    if types in ("simpo", "[cpo, sft]"):
        overrides[-1] = "reference.mode=none"
    with pytest.raises(ConfigError) as caught:
        load_config({}, overrides)
    assert str(caught.value).startswith(f"loss.label_smoothing is {smoothing}; ") and VANISHES in str(caught.value)
    load_config({}, [*overrides[:1], "loss.label_smoothing=0.49", overrides[2]])


def test_a_translated_label_smoothing_of_one_half_is_refused_naming_the_trl_field():
    for loss in ("aot", "robust", "exo_pair"):
        out = _outcome({"loss_type": loss, "label_smoothing": 0.5})
        assert VANISHES in out and out.endswith("(from the TRL config: loss.label_smoothing from label_smoothing 0.5)")
    assert "label_smoothing is -0.1; here it must be a finite number in [0, 1)" in _outcome({"label_smoothing": -0.1})


TRL_HOSTILE_YAML = """\
per_device_train_batch_size: .nan
warmup_ratio: .inf
learning_rate: .nan
max_steps: -.inf
lr_scheduler_type: [linear]
optim: {name: sgd}
loss_type: {a: 1}
report_to: 5
bf16: maybe
use_cpu: 2
1: one
null: none
"""

TRL_QUOTED_YAML = """\
bf16: 'false'
use_peft: 'no'
lora_target_modules: [q_proj]
precompute_ref_log_probs: 'false'
gradient_checkpointing: 'False'
sync_ref_model: 'n'
max_steps: 10
warmup_ratio: 1
"""


def test_dpo_train_from_trl_refuses_hostile_yaml_in_one_error_without_a_traceback(tmp_path):
    (tmp_path / "trl.yaml").write_text(TRL_HOSTILE_YAML)
    proc = run_process(cli_argv("train", "--from-trl", tmp_path / "trl.yaml"), code=2)
    assert "Traceback" not in proc.stderr and proc.stdout == ""
    assert proc.stderr.startswith("error: the TRL config does not translate")
    assert _named(proc.stderr) == [key.partition(":")[0] for key in TRL_HOSTILE_YAML.splitlines()][:-1] + ["None"]


def test_dpo_train_from_trl_reads_quoted_booleans_as_trl_does(tmp_path, run_cli):
    from dpo_cli.train import main

    (tmp_path / "trl.yaml").write_text(TRL_QUOTED_YAML)
    result = run_cli(main, "--from-trl", tmp_path / "trl.yaml")
    assert result.exit_code == 0, result.stderr
    (tmp_path / "train.yaml").write_text(result.stdout)
    config = load_config(tmp_path / "train.yaml")
    assert (config.train.precision, config.model.lora, config.reference.mode) == ("fp32", None, "live")
    assert (config.train.activation_checkpointing, config.reference.sync_ref_model) == (False, False)
    assert config.optim.warmup_steps == 10
    (tmp_path / "keys.yaml").write_text("true: 1\nbf16: 'false'\n")
    result = run_cli(main, "--from-trl", tmp_path / "keys.yaml")
    assert result.exit_code == 2 and "the key True is not a field name" in result.stderr


# -- issue 36: what recipes carry translates, and nothing is lost silently ----------------------------------------


def _hub_cache(monkeypatch, tmp_path: Path) -> Path:
    """An empty Hugging Face cache for this test (huggingface_hub reads its location at call time)."""
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    return tmp_path / "hub"


def _snapshot(cache: Path, kind: str, repo: str, files: list[str]) -> Path:
    """A repo's snapshot as a download leaves it: refs/main and snapshots/COMMIT/FILES."""
    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = cache / f"{kind}s--{repo.replace('/', '--')}"
    (folder / "refs").mkdir(parents=True)
    (folder / "refs" / "main").write_text(commit)
    for name in files:
        (folder / "snapshots" / commit / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / "snapshots" / commit / name).write_text("{}")
    return folder / "snapshots" / commit


def test_a_hub_model_id_is_resolved_from_the_local_cache_offline_or_refused_at_translation(monkeypatch, tmp_path):
    cache = _hub_cache(monkeypatch, tmp_path)
    with pytest.raises(ConfigError) as caught:
        translate({"model_name_or_path": "org/absent"})
    assert (
        f"model_name_or_path is 'org/absent': no such local directory, and a Hub model id that is not in the local "
        f"Hugging Face cache ({cache}); dpo-train never downloads: fetch it first (`hf download org/absent`) or "
        "give a local model directory (--set model.path=DIR)"
    ) in str(caught.value)
    snapshot = _snapshot(cache, "model", "org/present", ["config.json", "model.safetensors"])
    translated, notes = translate({"model_name_or_path": "org/present"})
    assert translated["model"]["path"] == str(snapshot)
    assert (
        "model_name_or_path org/present is a Hub id: model.path is its copy in the local Hugging Face cache, "
        f"{snapshot}" in notes
    )
    assert translate({"model_name_or_path": "org/absent"}, overrides=["model.path=/m"])[0]["model"]["path"] == "/m"
    assert translate({"model_name_or_path": "/models/x"})[0]["model"]["path"] == "/models/x"  # a path stays one


def test_a_dataset_name_suggests_its_local_path_or_a_concrete_hub_glob(monkeypatch, tmp_path):
    cache = _hub_cache(monkeypatch, tmp_path)
    local = tmp_path / "prefs.jsonl"
    local.write_text("{}\n")
    with pytest.raises(ConfigError) as caught:
        translate({"dataset_name": str(local), "output_dir": "/r/run"})
    assert (
        f"build it with `dpo-data build {local} --tokenizer MODEL_DIR --out /r/run-dataset --max-length 1024`"
        in str(caught.value)
    )
    assert "hf://datasets//" not in str(caught.value) and "GLOB" not in str(caught.value)
    assert "then translate again with --set data.path=/r/run-dataset" in str(caught.value)
    files = ["data/train_prefs-00000-of-00002.parquet", "data/train_prefs-00001-of-00002.parquet", "data/test.parquet"]
    _snapshot(cache, "dataset", "org/cached", files)
    trl = {"dataset_name": "org/cached", "dataset_train_split": "train_prefs"}
    notes = "\n".join(translate(trl, overrides=["data.path=/d"])[1])
    assert (
        "`dpo-data build 'hf://datasets/org/cached/data/train_prefs-*.parquet' --tokenizer MODEL_DIR --out /d" in notes
    )
    notes = "\n".join(translate({"dataset_name": "org/other"}, overrides=["data.path=/d"])[1])
    assert "`dpo-data build 'hf://datasets/org/other/data/train-*' --tokenizer MODEL_DIR --out /d" in notes


def test_an_eval_strategy_without_an_eval_set_is_a_note_and_eval_every_without_a_path_an_error():
    translated, notes = translate({"eval_strategy": "steps", "eval_steps": 7})
    assert "eval" not in translated
    assert (
        "eval_strategy is steps (every 7 steps), but there is no held-out set here yet, so the run evaluates "
        "nothing: build one (dpo-data build HELD_OUT_FILES ... --out DIR) and translate again with --set "
        "eval.path=DIR, which evaluates every 7 steps"
    ) in notes
    assert translate({"eval_strategy": "steps", "eval_steps": 7}, overrides=["eval.path=/e"])[0]["eval"] == {
        "every": 7,
        "path": "/e",
    }
    with pytest.raises(ConfigError, match=r"eval.every is 2, but eval.path is null, so there is nothing to evaluate"):
        load_config({"eval": {"every": 2}})


def test_report_to_dtype_and_push_to_hub_map_to_what_exists_here():
    translated, notes = translate(
        {"report_to": ["tensorboard", "wandb"], "torch_dtype": "bfloat16", "push_to_hub": True, "output_dir": "o/r"}
    )
    assert translated["train"]["report_to"] == ["tensorboard", "wandb"]
    assert translated["train"]["precision"] == "bf16"
    assert (
        "push_to_hub: after training, `dpo-state push o/r/final NAMESPACE/r` (NAMESPACE: your Hub user or organization)"
        in notes
    )
    assert translate({"dtype": "float32", "bf16": False})[0]["train"]["precision"] == "fp32"
    with pytest.raises(ConfigError, match=r"dtype is bfloat16 and bf16 is false; here bf16 is one setting"):
        translate({"dtype": "bfloat16", "bf16": False})
    with pytest.raises(ConfigError, match=r"report_to names all \(transformers' 'all'"):
        translate({"report_to": "all"})
    _, notes = translate({"hub_model_id": "me/x"})
    assert "hub_model_id is me/x but push_to_hub is false: nothing is pushed" in notes


def test_build_time_fields_are_the_printed_build_command_not_refusals():
    trl = {"max_length": 2048, "max_prompt_length": 512, "dataset_num_proc": 4, "model_name_or_path": "/m"}
    _, notes = translate(trl, overrides=["data.path=/d"])
    assert notes[0] == (
        "data.path is /d; the TRL config builds it with `dpo-data build RAW_FILES --tokenizer /m --out /d "
        "--max-length 2048 --num-proc 4 --overlength truncate-prompt`"
    )
    _, notes = translate({"max_length": None})
    assert notes[0] == (
        "data.path is empty: build the dataset (`dpo-data build RAW_FILES --tokenizer MODEL_DIR --out "
        "trainer_output-dataset`) and set data.path (--set data.path=DIR)"
    )
