"""Hostile round 4 (issue 55), a newcomer's and a TRL user's `dpo-train`: a mistyped input path named before
anything loads and with nothing left behind; a TRL recipe's run_name and `datasets:` list translated."""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

import pytest

from dpo_train.config.trl import translate
from dpo_train.config.trl_names import TABLE
from dpo_train.errors import ConfigError
from tests.harness import TINY_LLAMA, run_process, train_here, write_yaml

INIT = {"init": {"config": TINY_LLAMA, "seed": 0}}


def _listing(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*"))


def _imported(stderr: str) -> set[str]:
    """The modules `python -X importtime` says the process imported."""
    return {line.rsplit("|", 1)[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("nproc", [1, 2])
def test_a_mistyped_data_path_is_named_before_torch_loads_and_leaves_nothing_behind(tmp_path, nproc):
    """It was named after torch and the tokenizer loaded, as 'not a committed dataset, manifest.json is missing',
    and the failed run left OUTPUT/config.resolved.yaml and OUTPUT.lock behind (with --nproc-per-node 2, after
    torchrun had started both ranks)."""
    (tmp_path / "train-data").mkdir()
    config = {"model": INIT, "data": {"path": "./train-dat"}, "train": {"output_dir": "runs/first", "max_steps": 1}}
    path = write_yaml(tmp_path / "c.yaml", config)
    before = _listing(tmp_path)
    launch = ["--nproc-per-node", nproc] if nproc > 1 else []
    argv = [sys.executable, "-X", "importtime", "-m", "dpo_cli.train", path, "--quiet", *launch]
    proc = run_process(argv, cwd=tmp_path, code=2)
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert errors[0].startswith("error: data.path ./train-dat: no such directory (relative to the working directory")
    assert "did you mean 'train-data'? fix: set data.path to a directory written by `dpo-data build`" in errors[0]
    imported = _imported(proc.stderr)
    assert imported and not imported & {"torch", "transformers", "torch.distributed.run"}
    assert _listing(tmp_path) == before  # no runs/, no runs/first.lock


def test_every_missing_input_is_named_at_once_and_a_sidecar_only_where_the_run_reads_it(tmp_path, run_cli):
    """eval.path and a precomputed reference.path (set by --set) are named together; --precompute-reference writes
    reference.path and reads no eval.path, so it goes on to the data, whose directory without a manifest keeps its
    own message."""
    (tmp_path / "data").mkdir()
    config = {"model": INIT, "data": {"path": str(tmp_path / "data")}, "train": {"output_dir": str(tmp_path / "run")}}
    path = write_yaml(tmp_path / "c.yaml", config)
    sets = ["--set", f"eval.path={tmp_path / 'held-out'}", "--set", "reference.mode=precomputed"]
    sets += ["--set", f"reference.path={tmp_path / 'ref'}"]
    stderr = train_here(run_cli, path, *sets, code=2).stderr
    assert stderr.startswith("error: the config names inputs that are not directories:\n"), stderr
    assert f"  - eval.path {tmp_path / 'held-out'}: no such directory; fix: set eval.path" in stderr
    assert f"  - reference.path {tmp_path / 'ref'}: no such directory; fix: set reference.path to the sidecar" in stderr
    stderr = train_here(run_cli, path, *sets, "--precompute-reference", code=2).stderr
    assert f"error: {tmp_path / 'data'}: not a committed dataset, manifest.json is missing" in stderr, stderr
    assert _listing(tmp_path) == ["c.yaml", "data"]


def test_a_run_set_up_in_code_names_a_missing_input_before_its_output_dir_exists(tmp_path):
    """A caller of `training_run` (no CLI) gets the same check, before the lock and config.resolved.yaml."""
    from dpo_train.config.loading import load_config
    from dpo_train.run import training_run

    out = tmp_path / "run"
    config = load_config({"model": INIT, "data": {"path": str(tmp_path / "nope")}, "train": {"output_dir": str(out)}})
    with pytest.raises(ConfigError, match=r"data.path .*nope: no such directory; fix: set data.path"):
        with training_run(config, progress=False):
            pass
    assert _listing(tmp_path) == []


def _from_trl(run_cli, tmp_path: Path, trl: dict, *args):
    import dpo_cli.train

    return run_cli(dpo_cli.train.main, "--from-trl", write_yaml(tmp_path / "trl.yaml", trl), *args)


def test_a_trl_run_name_is_accepted_with_a_note_that_quotes_it(run_cli, tmp_path):
    """Any run_name was refused ("this toolkit has no counterpart"), where the docs said it changes nothing."""
    result = _from_trl(run_cli, tmp_path, {"run_name": "dpo exp-1; touch x"}, "--set", "data.path=built")
    assert result.exit_code == 0, result.stderr
    assert "note: run_name 'dpo exp-1; touch x' names the run in TRL's loggers only" in result.stderr
    assert "`WANDB_NAME='dpo exp-1; touch x' dpo-train CONFIG`" in result.stderr  # quoted: safe to paste


def test_trls_datasets_list_translates_as_trl_dpo_reads_it(run_cli, tmp_path):
    """TRL's own `datasets:` (DatasetMixtureConfig, which `trl dpo` trains) was "not a field of TRL 1.16's ...":
    each entry's split, or its data_files, is an input of the printed build; its siblings are known too."""
    trl = pytest.importorskip("trl")
    assert [f.name for f in dataclasses.fields(trl.DatasetMixtureConfig) if f.name not in TABLE] == []
    datasets = [{"path": "json", "data_files": "rows.jsonl"}, {"path": "org/prefs", "split": "train_prefs"}]
    recipe = {"datasets": datasets, "streaming": False, "test_split_size": 0.1}
    result = _from_trl(run_cli, tmp_path, recipe, "--set", "data.path=built")
    assert result.exit_code == 0, result.stderr
    assert "`dpo-data build rows.jsonl 'hf://datasets/org/prefs/data/train_prefs-*' --tokenizer" in result.stderr
    assert "note: test_split_size 0.1 holds rows of datasets out as TRL's eval set" in result.stderr
    assert "accepted, changing nothing here: streaming" in result.stderr


@pytest.mark.parametrize(
    ("recipe", "named"),
    [
        ({"datasets": [{"path": "org/a", "name": "hard"}]}, "datasets[0] names config 'hard': the build reads files"),
        ({"datasets": [{"path": "org/a", "fraction": 0.5}]}, "datasets[0].fraction is 0.5; here each input is built"),
        ({"datasets": [{"path": "org/a", "columns": ["prompt"]}]}, "datasets[0].columns is ['prompt']; here the"),
        ({"datasets": [{"path": "org/a", "data_dir": "d"}]}, "datasets[0].data_dir is 'd'; here give its files"),
        ({"datasets": [{"path": "csv", "data_files": "a.csv"}]}, "datasets[0].path is 'csv' with data_files: the"),
        ({"datasets": [{"id": "org/a"}]}, "datasets is [{'id': 'org/a'}]; TRL's form is a list of {path:"),
        (
            {"dataset_name": "org/b", "datasets": [{"path": "org/a"}]},
            "dataset_name is 'org/b' beside datasets: TRL trains datasets and ignores dataset_name",
        ),
    ],
    ids=["name", "fraction", "columns", "data_dir", "csv", "no-path", "beside-dataset_name"],
)
def test_a_datasets_entry_that_would_build_other_rows_is_refused_by_name(recipe, named):
    with pytest.raises(ConfigError) as refused:
        translate(recipe)
    assert named in str(refused.value) and "not a field" not in str(refused.value)
