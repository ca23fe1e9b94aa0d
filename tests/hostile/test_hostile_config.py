"""Hostile configs: YAML that could hang or fool the trainer, bad numbers, model paths, TensorBoard dirs, tied LoRA."""

from __future__ import annotations

import copy
import re
import subprocess
from pathlib import Path

import orjson
import pytest
import torch

from dpo_state.schema import load_schema
from dpo_train.config.loading import load_config
from dpo_train.config.sections import ModelConfig
from dpo_train.errors import ConfigError
from tests.harness import TINY_LLAMA, train_cli, train_here
from tests.hostile.test_hostile_run import small_tmpfs
from tests.tiny import tiny_llama, tiny_llama_model
from tests.train.checkpoint.test_checkpoint import config

DOCS = Path(__file__).resolve().parents[2] / "docs" / "train-config.md"
ANYWHERE = {"data": {"path": "x"}}  # load_config alone never opens the dataset


def refused(*overrides: str, source=ANYWHERE) -> str:
    """load_config's ConfigError for `source` with `overrides`: its message."""
    with pytest.raises(ConfigError) as info:
        load_config(source, list(overrides))
    return str(info.value)


def no_traceback(proc) -> str:
    assert "Traceback" not in proc.stderr and "Exception in thread" not in proc.stderr, proc.stderr[-3000:]
    return proc.stderr


# -- config files cannot hang or fool the trainer ---------------------------------------------------------


@pytest.mark.parametrize(
    "text, match",
    [
        ("model:\n  init:\n    config: &a [1, 1]\n    seed: *a\n", r"line 3: the anchor &a is not allowed"),
        ("data: {path: x}\noptim: {lr: 1.0e-5}\noptim: {lr: 2.0e-5}\n", r"line 3: the key 'optim' appears twice"),
        ("optim: {lr: 1.0e-5, lr: 2.0e-5}\n", r"the key 'lr' appears twice"),
        ("model: {init: {config: {}, sed: 0}}\n", r"model/init: Additional properties are not allowed \('sed'"),
        ("format_version: 2\n", r"format_version is 2; this dpo-train reads config format_version 1"),
    ],
)
def test_a_config_that_could_hang_or_fool_the_trainer_is_refused(tmp_path, text, match):
    path = tmp_path / "c.yaml"
    path.write_text(text)
    assert re.search(match, refused(source=path))


def test_an_alias_bomb_is_refused_at_once(tmp_path):
    levels = ["a0: &a0 [x, x, x, x, x, x, x, x, x, x]"]
    levels += [f"a{i}: &a{i} [{', '.join([f'*a{i - 1}'] * 10)}]" for i in range(1, 9)]
    path = tmp_path / "bomb.yaml"
    path.write_text("model:\n  init:\n    config:\n" + "".join(f"      {line}\n" for line in levels))
    assert "anchor &a0 is not allowed" in refused(source=path)


@pytest.mark.parametrize(
    "override, key",
    [
        ("optim.lr=.inf", "optim.lr"),
        ("optim.lr=.nan", "optim.lr"),
        ("loss.beta=.inf", "loss.beta"),
        ("optim.max_grad_norm=.nan", "optim.max_grad_norm"),
        ("optim.weight_decay=.nan", "optim.weight_decay"),
        ("optim.betas=[.nan, 0.9]", r"optim.betas\[0\]"),
    ],
)
def test_a_non_finite_number_is_refused_naming_its_key(override, key):
    assert re.search(rf"^{key}: not a finite number", refused(override))


def test_bad_config_files_and_overrides_are_named_errors_not_tracebacks(tmp_path, run_cli):
    (tmp_path / "binary.yaml").write_bytes(bytes(range(256)))
    assert "is not UTF-8 text" in refused(source=tmp_path / "binary.yaml")
    (tmp_path / "nul.yaml").write_bytes(b"optim: {lr: 1}\x00\n")
    assert "holds NUL bytes" in refused(source=tmp_path / "nul.yaml")
    assert "is a directory; pass a YAML file" in refused(source=tmp_path)
    assert "--set 'optim.lr=[1,': the value is not valid YAML" in refused("optim.lr=[1,")
    stderr = no_traceback(train_here(run_cli, tmp_path / "binary.yaml", code=2))
    assert "error: config file" in stderr


def test_a_config_file_that_cannot_be_read_fails_before_torch_loads_or_ranks_start(tmp_path, run_cli):
    # not --quiet, so that the imports' progress line would show: the error comes before it (3 s of torch), and
    # before torchrun starts a process per rank to fail each alike
    from dpo_cli.train import main

    missing, binary = tmp_path / "nowhere.yaml", tmp_path / "binary.yaml"
    binary.write_bytes(bytes(range(256)))
    for args, line in (
        ([missing], f"error: config file {missing} does not exist; pass a YAML file"),
        ([missing, "--nproc-per-node", 2], f"error: config file {missing} does not exist; pass a YAML file"),
        ([tmp_path, "--nproc-per-node", 2], f"error: config file {tmp_path} is a directory; pass a YAML file"),
        ([binary], f"error: config file {binary} is not UTF-8 text"),
        (["/dev/null"], "error: config file /dev/null is not a regular file (a device, a pipe or a socket)"),
    ):
        result = run_cli(main, *args)
        assert result.exit_code == 2 and result.stderr.splitlines()[0].startswith(line), result.stderr
        assert len(result.stderr.splitlines()) == 1, result.stderr


def test_a_config_format_version_is_checked_not_dropped():
    assert "format_version is 7" in refused(source={"format_version": 7, "data": {"path": "x"}})


# -- sections and numbers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("text, shown", [("loss: 1e308", "1e+308"), ("loss: [1, 2]", "[1, 2]"), ("model: 5", "5")])
def test_a_section_given_as_anything_but_a_mapping_is_named(tmp_path, text, shown):
    """Already named before item 9; kept so that it stays so."""
    path = tmp_path / "c.yaml"
    path.write_text(f"data: {{path: x}}\n{text}\n")
    section = text.split(":")[0]
    assert f"section '{section}' must be a mapping, got {shown}" in refused(source=path)


@pytest.mark.parametrize(
    "override, line",
    [
        ("loss.beta=1e308", "loss/beta: 1e+308 is greater than the maximum of 1000; allowed: a number in (0, 1_000]"),
        (
            "data.pairs_per_step=1e30",
            "data/pairs_per_step: 1e+30 is greater than the maximum of 1000000; allowed: an integer in [1, 1_000_000]",
        ),
        (f"data.pairs_per_step={10**30}", f"data/pairs_per_step: {10**30} is greater than the maximum of 1000000"),
        (
            f"train.seed={2**70}",
            f"train/seed: {2**70} is greater than the maximum of {2**63 - 1}; allowed: an "
            "integer in [0, 9_223_372_036_854_775_807]",
        ),
        ("data.seed=-1", "data/seed: -1 is less than the minimum of 0; allowed: an integer in [0, 9_223_372"),
        (f"model.init={{config: {{}}, seed: {2**70}}}", "model/init/seed: 1180591620717411303424 is greater than"),
        ("optim.lr=1e300", "optim/lr: 1e+300 is greater than the maximum of 100; allowed: a number in (0, 100]"),
        ("optim.eps=1e-320", "optim/eps: 1e-320 is less than the minimum of 1e-30; allowed: a number in [1e-30, 1]"),
        ("optim.weight_decay=1e300", "optim/weight_decay: 1e+300 is greater than the maximum of 10"),
        ("optim.max_grad_norm=1e300", "optim/max_grad_norm: 1e+300 is greater than the maximum of 1000000000000"),
        ("optim.betas=[0.9, 1e300]", "optim/betas/1: 1e+300 is greater than or equal to the maximum of 1"),
        ("optim.warmup_steps=4611686018427387904", "optim/warmup_steps: 4611686018427387904 is greater than"),
        ("data.weights=[1e300]", "data/weights/0: 1e+300 is greater than the maximum of 1000"),
        ("model.lora={r: 1e30}", "model/lora/r: 1e+30 is greater than the maximum of 65536"),
        (f"distributed.sequence_parallel={{ulysses: {2**70}}}", "distributed/sequence_parallel/ulysses: 11805916"),
        ("eval.every=1e300", "eval/every: 1e+300 is greater than the maximum of 1000000000"),
    ],
)
def test_a_number_outside_its_keys_range_is_refused_naming_the_key_the_value_and_the_range(override, line):
    """Before, each loaded: it crashed later (orjson, torch.manual_seed, numpy's SeedSequence, Adam's float
    conversion, a weight index), or trained to NaN weights exported with exit 0 (eps, weight_decay)."""
    message = refused(override)
    assert message.startswith("the config does not match schemas/train-config.schema.json")
    assert line in message and 'docs/train-config.md, "Bounds"' in message


def test_an_integer_beyond_64_bits_in_a_free_mapping_is_refused():
    message = refused(f"model.init={{config: {{hidden_size: {2**70}}}}}")
    assert "model.init.config.hidden_size is 1180591620717411303424; an integer in a config must lie in " in message
    assert "[-9_223_372_036_854_775_808, 9_223_372_036_854_775_807]" in message


def test_an_integer_written_as_a_float_is_read_as_the_integer():
    loaded = load_config(ANYWHERE, ["data.max_tokens_per_microbatch=4e3", "model.lora={r: 8.0}", "train.seed=1e18"])
    assert (loaded.data.max_tokens_per_microbatch, loaded.model.lora["r"], loaded.train.seed) == (4000, 8, 10**18)
    assert all(type(v) is int for v in (loaded.data.max_tokens_per_microbatch, loaded.model.lora["r"]))
    orjson.dumps(loaded.resolved())  # what the run writes
    assert "4.5 is not of type 'integer'" in refused("data.max_tokens_per_microbatch=4.5")


def _numeric_keys(node: dict, path: str = ""):
    types = node.get("type", [])
    if {"integer", "number"} & set([types] if isinstance(types, str) else types):
        yield path, node
    for key, child in node.get("properties", {}).items():
        yield from _numeric_keys(child, f"{path}.{key}" if path else key)
    if isinstance(node.get("items"), dict):
        yield from _numeric_keys(node["items"], f"{path}[]")


def test_every_number_of_the_schema_is_bounded_and_the_docs_table_is_the_schemas():
    from dpo_train.config.loading import _allowed

    keys = list(_numeric_keys(load_schema("train-config")))
    ends = ({"minimum", "exclusiveMinimum"}, {"maximum", "exclusiveMaximum"})
    assert [p for p, n in keys if not all(end & set(n) for end in ends)] == []
    table = DOCS.read_text().split("<!-- bounds:start -->\n")[1].split("<!-- bounds:end -->")[0]
    expected = "| key | allowed |\n|---|---|\n" + "".join(f"| `{p}` | {_allowed(n)} |\n" for p, n in keys)
    assert table == expected
    assert load_config(ANYWHERE).resolved()  # every default lies inside its range


def test_the_cli_refuses_numbers_out_of_range_before_anything_is_written(small_dataset, smollm2_dir, tmp_path, run_cli):
    """Before: `Integer exceeds 64-bit range` from orjson writing the run identity, exit 1, a traceback."""
    path, out = config(tmp_path, small_dataset, smollm2_dir, "big", data__pairs_per_step=10**30, train__seed=2**70)
    stderr = no_traceback(train_here(run_cli, path, code=2))
    assert f"data/pairs_per_step: {10**30} is greater than the maximum of 1000000" in stderr
    assert f"train/seed: {2**70} is greater than the maximum" in stderr
    assert not out.exists()


# -- model paths ------------------------------------------------------------------------------------------------


def test_a_model_path_that_is_not_a_model_directory_is_named(tmp_path):
    from dpo_train.model.policy import load_policy

    def message(**model) -> str:
        with pytest.raises(ConfigError) as info:
            load_policy(ModelConfig(**model))
        return str(info.value)

    missing, empty, a_file = tmp_path / "nowhere", tmp_path / "empty", tmp_path / "file"
    empty.mkdir()
    a_file.write_text("{}")
    assert message(path=str(missing)) == (
        f"model.path {missing} does not exist; pass a local model directory (dpo-train is offline: a Hub repo id "
        "is not downloaded)"
    )
    assert message(path="org/model-name").startswith("model.path org/model-name does not exist")  # never the Hub
    assert message(path=str(a_file)).startswith(f"model.path {a_file} is a file, not a model directory")
    assert message(path=str(empty)).startswith(f"model.path {empty} is not a model directory: no config.json")
    spec = {"init": {"config": TINY_LLAMA}}
    assert message(**spec, tokenizer=str(missing)).startswith(f"model.tokenizer {missing} does not exist")
    assert message(init={"config": str(missing)}).startswith(f"model.init.config {missing} does not exist")


@pytest.mark.parametrize("field, value", [("initializer_range", 100.0), ("hidden_size", -5)])
def test_a_model_init_config_that_transformers_refuses_is_named(field, value):
    from dpo_train.model.policy import load_policy

    named = field.replace("_", ".")  # 'initializer_range', or 'The hidden size (-5) is not a multiple ...'
    with pytest.raises(ConfigError, match=rf"^model.init.config: transformers cannot build .*{named}.*{value}"):
        load_policy(ModelConfig(init={"config": tiny_llama(**{field: value})}))


def test_the_cli_names_a_missing_model_path_before_writing_the_run(small_dataset, smollm2_dir, tmp_path, run_cli):
    """Before: "Repo id must be in the form 'repo_name'" from huggingface_hub, after config.resolved.yaml
    was written. Needs `check_model_paths` called in trainer._check_settings."""
    missing = tmp_path / "no-such-model"
    # the brief's case: model.path alone, so that the tokenizer is looked for there too
    path, out = config(
        tmp_path,
        small_dataset,
        smollm2_dir,
        "nomodel",
        model__path=str(missing),
        model__init=None,
        model__tokenizer=None,
    )
    stderr = no_traceback(train_here(run_cli, path, code=2))
    assert f"error: model.path {missing} does not exist; pass a local model directory" in stderr
    assert "Repo id" not in stderr and not (out / "config.resolved.yaml").exists()


# -- LoRA on embeddings -----------------------------------------------------------------------------------------


def _tiny(tied: bool):
    torch.manual_seed(0)
    return tiny_llama_model(vocab_size=100, num_hidden_layers=1, tie_word_embeddings=tied)


@pytest.mark.parametrize(
    "targets, named",
    [
        (["embed_tokens"], "model.embed_tokens shares its weight with lm_head"),
        (["lm_head"], "lm_head shares its weight with model.embed_tokens"),
        (["embed_tokens", "q_proj"], "model.embed_tokens shares its weight with lm_head"),
    ],
)
def test_lora_on_a_tied_layer_is_refused_naming_it(targets, named):
    """Before, it trained; a merged export then held the adapter in lm_head too (the weight is one), so the
    merged model's logits differed from the trained policy's by hundreds on this tiny model."""
    from dpo_train.model.lora import apply_lora

    with pytest.raises(ConfigError, match="adapts a tied layer") as info:
        apply_lora(_tiny(tied=True), {"r": 2, "target_modules": targets})
    assert named in str(info.value) and "a merged model would not be the trained one" in str(info.value)
    apply_lora(_tiny(tied=True), {"r": 2, "target_modules": ["q_proj"]})  # untied layers of a tied model


def test_lora_on_an_untied_embedding_merges_into_the_model_it_trained():
    from dpo_train.model.lora import apply_lora
    from dpo_train.model.policy import embedding_rows

    model = apply_lora(_tiny(tied=False), {"r": 2, "target_modules": ["embed_tokens", "q_proj"]})
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora" in name:
                parameter.normal_()
    ids = torch.arange(12)[None]
    adapted = model(input_ids=ids).logits
    assert embedding_rows(model) == 100  # PEFT's Embedding has no num_embeddings
    merged = copy.deepcopy(model).merge_and_unload()
    torch.testing.assert_close(merged(input_ids=ids).logits, adapted, rtol=1e-5, atol=1e-5)


def test_the_cli_trains_and_exports_lora_on_an_untied_embedding(small_dataset, smollm2_dir, tmp_path):
    """Before: AttributeError "'Embedding' object has no attribute 'num_embeddings'" (exit 1). Needs
    `embedding_rows` in trainer.py and preflight.check_vocabulary."""
    lora = {"r": 2, "target_modules": ["embed_tokens", "q_proj"]}
    path, out = config(
        tmp_path, small_dataset, smollm2_dir, "emb", model__lora=lora, train__max_steps=2, train__export="both"
    )
    no_traceback(train_cli(path))
    assert (out / "final" / "adapter_model.safetensors").is_file() and (out / "final-merged" / "config.json").is_file()


# -- the TensorBoard directory ----------------------------------------------------------------------------------


def _tensorboard_run(tmp_path, small_dataset, smollm2_dir, name, **over):
    return config(
        tmp_path, small_dataset, smollm2_dir, name, train__report_to=["tensorboard"], train__save_every=0, **over
    )


def _no_step_logged(out: Path) -> bool:
    return not (out / "metrics.jsonl").exists() or (out / "metrics.jsonl").read_text() == ""


def test_a_file_where_the_tensorboard_directory_belongs_is_a_config_error(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    """Before: FileExistsError from tensorboard's makedirs, a traceback, exit 1."""
    path, out = _tensorboard_run(tmp_path, small_dataset, smollm2_dir, "tbfile", train__max_steps=1)
    out.mkdir()
    (out / "tensorboard").write_text("not a directory")
    stderr = no_traceback(train_here(run_cli, path, code=2))
    assert (
        f"error: train.report_to: tensorboard writes its event files into {out}/tensorboard, which is a file" in stderr
    )
    assert _no_step_logged(out)


def test_a_read_only_tensorboard_directory_is_an_environment_error(small_dataset, smollm2_dir, tmp_path, run_cli):
    path, out = _tensorboard_run(tmp_path, small_dataset, smollm2_dir, "tbro", train__max_steps=1)
    with small_tmpfs(out / "tensorboard", 1) as ro:
        subprocess.run(["mount", "-o", "remount,ro", str(ro)], check=True)
        stderr = no_traceback(train_here(run_cli, path, code=1))
        assert f"tensorboard cannot write its event files into {ro} (Read-only file system)" in stderr
        assert _no_step_logged(out)


def test_a_full_tensorboard_disk_is_an_environment_error_before_the_first_step(tmp_path):
    from dpo_train.errors import WriteError
    from dpo_train.run.sinks import check_sinks

    with small_tmpfs(tmp_path / "run" / "tensorboard", 1) as full:
        with open(full / "filler", "wb", buffering=0) as f, pytest.raises(OSError):
            while True:
                f.write(bytes(1 << 16))
        with pytest.raises(WriteError, match=re.escape(f"into {full} (No space left on device)")) as info:
            check_sinks(["tensorboard"], tmp_path / "run")
        assert info.value.exit_code == 1 and [p.name for p in full.iterdir()] == ["filler"]


def test_a_tensorboard_disk_that_fills_up_during_the_run_is_named(small_dataset, smollm2_dir, tmp_path):
    """The 4 KiB probe fits, the events outgrow the 8 KiB left after a few steps: named, exit 1, and neither
    the main thread's nor the event writer thread's traceback."""
    path, out = _tensorboard_run(tmp_path, small_dataset, smollm2_dir, "tblate", train__max_steps=30, train__epochs=6)
    with small_tmpfs(out / "tensorboard", 1) as disk:
        (disk / "filler").write_bytes(bytes((1 << 20) - (8 << 10)))
        stderr = no_traceback(train_cli(path, code=1))
        assert "tensorboard cannot write its event files into" in stderr and "(No space left on device)" in stderr
        assert (out / "metrics.jsonl").read_text().count("\n") < 30
