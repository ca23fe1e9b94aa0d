"""Hostile round 4 (issue 55), a newcomer's and a TRL user's `dpo-train`: a mistyped input path named before
anything loads and with nothing left behind; one meaning per metric name, TRL's (`rewards/margins` beta-scaled in
eval.jsonl as in metrics.jsonl); a TRL recipe's run_name and `datasets:` list translated."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

import pytest

from dpo_train.config.trl import translate
from dpo_train.config.trl_table import TABLE
from dpo_train.errors import ConfigError
from tests.harness import TINY_LLAMA, run_process, state_here, tiny_trainer, train_here, write_yaml
from tests.report.test_report import _metrics_line

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


def test_the_held_out_reward_margin_is_trls_beta_scaled_one_as_in_training(small_dataset):
    """eval.jsonl's `margin` was the raw log-ratio margin (+5.4 in the demo) beside metrics.jsonl's beta-scaled
    `rewards/margins` (about 0.44): one name read as one metric, ten times apart. Now `rewards/margins` in both is
    the loss's chosen minus rejected reward, as TRL logs it, and the raw one is `logratio_margin`."""
    from dpo_data.loading.microbatch import pack_microbatch
    from dpo_train.evaluation import Evaluator
    from dpo_train.step.metrics import SUMS

    config = {"model": INIT, "data": {"path": str(small_dataset), "max_tokens_per_microbatch": 300}}
    config |= {"loss": {"beta": 0.5}, "optim": {"lr": 0.05}, "train": {"output_dir": "unused"}}
    trainer = tiny_trainer(config)
    pairs = [trainer.store.pair(i) for i in range(8)]
    batch = pack_microbatch(pairs, pad_to_multiple_of=8)
    batch.update(
        microbatch=0, microbatches_in_step=1, step_pairs=8, step_chosen_tokens=sum(len(p.chosen) for p in pairs)
    )
    trainer.microbatch(batch)
    trainer.step()
    held_out = dataclasses.replace(trainer.run, held_out=trainer.store)
    record = Evaluator(held_out, trainer.reference.initial, trainer.scoring).run(trainer.model, step=1)
    assert "margin" not in record and record["format_version"] == 4
    assert record["rewards/margins"] == pytest.approx(0.5 * record["logratio_margin"], rel=1e-6)
    assert abs(record["logratio_margin"]) > 1e-3  # the policy moved: beta-scaled and raw differ
    trainer.sums.zero_()
    trainer.microbatch(batch)  # the training metric of the same 8 pairs, read off the step's sums
    sums = dict(zip(SUMS, trainer.sums[0].tolist()))
    subset = dataclasses.replace(trainer.run, held_out=_first_pairs(trainer.store, 8))
    again = Evaluator(subset, trainer.reference.initial, trainer.scoring).run(trainer.model, step=1)
    assert again["rewards/margins"] == pytest.approx(sums["margin"] / sums["pairs"], rel=1e-5)


def _first_pairs(store, n: int):
    """`store` seen as its first `n` pairs (the evaluator reads num_pairs, pair(i) and segment_tokens)."""

    class First:
        def __getattr__(self, name):
            return getattr(store, name)

        num_pairs = n

    return First()


def test_the_report_reads_an_older_margin_as_the_log_ratio_one_and_never_as_trls(tmp_path, run_cli):
    """A run resumed across the change: its step-0 evaluation (format 3) has `margin`, the raw log-ratio margin;
    the report names it logratio_margin and leaves TRL's rewards/margins unknown there, never 5.4 under TRL's
    name; the format-4 record after training carries both."""
    (tmp_path / "metrics.jsonl").write_text(json.dumps(_metrics_line(3, 0, 0.69, 0.69, 0.69)) + "\n")
    common = {"pairs": 8, "ties": 0.0, "logp_accuracy": 0.9, "loss": 0.6, "pair_loss": 0.6, "nll": 1.0}
    before = {"format_version": 3, "step": 0, "accuracy": 0.0, "margin": 0.0, **common}
    after = {"format_version": 4, "step": 1, "accuracy": 0.8, "rewards/margins": 0.54, "logratio_margin": 5.4}
    lines = [before, {**after, **common}]
    (tmp_path / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in lines))
    report = json.loads(state_here(run_cli, "report", tmp_path, "--json").stdout)
    assert report["format_version"] == 4 and "margin" not in report["eval"]
    assert report["eval"]["rewards/margins"] == [None, 0.54]
    assert report["eval"]["logratio_margin"] == [0.0, 5.4]
    assert report["summary"]["eval_before"]["rewards/margins"] is None


def test_early_stopping_on_the_old_margin_name_is_refused_with_what_it_became():
    from dpo_train.config.loading import load_config

    eval_keys = {"path": "held-out", "every": 2, "early_stopping_metric": "margin"}
    with pytest.raises(ConfigError) as refused:
        load_config({"data": {"path": "x"}, "eval": eval_keys})
    message = str(refused.value)
    assert "eval.early_stopping_metric is 'margin': eval.jsonl's `margin` (the raw log-ratio margin)" in message
    assert "set logratio_margin to watch it as before" in message and "or rewards/margins" in message
    for metric in ("rewards/margins", "logratio_margin"):
        assert load_config({"data": {"path": "x"}, "eval": {**eval_keys, "early_stopping_metric": metric}})
