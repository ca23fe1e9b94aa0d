"""`train.report_to: [wandb]`: an offline W&B run holds the TensorBoard sink's scalars on its axis, a resume
continues the run, and a missing package or a run wandb cannot start is a named error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import yaml

from tests.harness import tiny_config, train_here, write_yaml

_BLOCK, _HEADER = 32768, 7  # the .wandb file: LevelDB's log format, 32 KiB blocks, 7-byte record headers
_FULL, _LAST = 1, 4


def wandb_records(path: Path) -> list:
    """The protobuf records of a .wandb file, in order (wandb 0.31 ships no reader of its own)."""
    from wandb.proto import wandb_internal_pb2

    data, records, parts = path.read_bytes(), [], b""
    assert data[:4] == b":W&B"
    pos = _HEADER
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        length, kind = int.from_bytes(data[pos + 4 : pos + 6], "little"), data[pos + 6]
        parts += data[pos + _HEADER : pos + _HEADER + length]
        pos += _HEADER + length
        if kind in (_FULL, _LAST):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(parts)
            records.append(record)
            parts = b""
    return records


def _history(records: list) -> dict[int, dict]:
    """Each history row by its `_step`, with the row's user keys and its `_timestamp`."""
    rows = {}
    for r in records:
        if r.WhichOneof("record_type") == "history":
            row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in r.history.item}
            step = row.pop("_step")
            rows[step] = {k: v for k, v in row.items() if k != "_runtime"}
    return rows


def _run_record(records: list):
    return next(r.run for r in records if r.WhichOneof("record_type") == "run")


def _lines(out: Path, log: str) -> list[dict]:
    return [json.loads(x) for x in (out / log).read_text().splitlines()]


@pytest.fixture
def offline(monkeypatch, tmp_path) -> Path:
    """wandb offline, every file it writes under tmp_path (its run files under WANDB_DIR/wandb/)."""
    root = tmp_path / "wandb-root"
    for name, value in {
        "WANDB_MODE": "offline",
        "WANDB_DIR": root,
        "WANDB_CONFIG_DIR": tmp_path / "wandb-config",
        "WANDB_CACHE_DIR": tmp_path / "wandb-cache",
        "WANDB_DATA_DIR": tmp_path / "wandb-data",
        "WANDB_PROJECT": "sinks-test",
    }.items():
        monkeypatch.setenv(name, str(value))
    for name in ("WANDB_RUN_ID", "WANDB_NAME"):
        monkeypatch.delenv(name, raising=False)
    return root


def test_an_offline_wandb_run_holds_the_tensorboard_scalars_and_a_resume_continues_it(
    small_dataset, smollm2_dir, tmp_path, run_cli, monkeypatch, offline
):
    """4 steps, checkpoints every 2, eval every 2; the first session fails reading the fourth step (after the
    checkpoint of 2 steps, having logged steps done 1..3), the second resumes and logs 3 and 4. Each session
    is an offline-run directory of the same run id, the one OUTPUT/wandb-run.json keeps; every scalar of
    metrics.jsonl and eval.jsonl is there under its TensorBoard name at its TensorBoard step, with the step's
    time, and the W&B config is the resolved config."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from dpo_state.run_logs import step_scalars

    out = tmp_path / "run"
    config = tiny_config(small_dataset, smollm2_dir, out, max_steps=4, save_every=2, report_to=["tensorboard", "wandb"])
    config["eval"] = {"path": str(small_dataset), "every": 2}
    path = write_yaml(tmp_path / "run.yaml", config)
    monkeypatch.setenv("DPO_TRAIN_FAULT", "0:3")
    train_here(run_cli, path, code=None)
    monkeypatch.delenv("DPO_TRAIN_FAULT")
    train_here(run_cli, path)

    run_id = json.loads((out / "wandb-run.json").read_text())["run_id"]
    sessions = sorted((offline / "wandb").glob("offline-run-*"))
    assert [s.name.rsplit("-", 1)[1] for s in sessions] == [run_id, run_id]
    first, second = (wandb_records(s / f"run-{run_id}.wandb") for s in sessions)
    assert sorted(_history(first)) == [0, 1, 2, 3] and sorted(_history(second)) == [3, 4]
    run = _run_record(second)
    assert (run.run_id, run.project, run.display_name) == (run_id, "sinks-test", "run")
    config_keys = {u.key: json.loads(u.value_json) for u in run.config.update if u.key != "_wandb"}
    assert config_keys == yaml.safe_load((out / "config.resolved.yaml").read_text())

    rows = {**_history(first), **_history(second)}  # the resumed session's row of a step trained again
    expected: dict[int, dict] = {}
    for record in _lines(out, "metrics.jsonl"):
        scalars = {k: v for k, v in step_scalars(record).items() if v is not None}
        expected[record["step"] + 1] = {**scalars, "_timestamp": record["time"]}
    for record in _lines(out, "eval.jsonl"):
        scalars = {f"eval/{k}": v for k, v in record.items() if k not in ("format_version", "step")}
        expected.setdefault(record["step"], {}).update({k: v for k, v in scalars.items() if v is not None})
    assert any(name.startswith("sources/") for row in expected.values() for name in row)
    assert rows.keys() == expected.keys() == {0, 1, 2, 3, 4}
    for step, row in expected.items():
        logged = rows[step].pop("_timestamp")  # wandb's own time for the step-0 evaluation's row
        assert logged == pytest.approx(row.pop("_timestamp", logged), abs=1e-6), step  # the step's time
        assert rows[step] == row, step  # the same names, the values as metrics.jsonl has them

    events = EventAccumulator(str(out / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    tensorboard = {(name, e.step) for name in events.Tags()["scalars"] for e in events.Scalars(name)}
    assert tensorboard == {(name, step) for step, row in rows.items() for name in row if name != "_timestamp"}


def test_a_fresh_start_in_the_same_directory_is_a_new_wandb_run(tmp_path, monkeypatch, offline):
    """The id is kept for a resume only: a fresh start replaces the logs, and so begins another W&B run."""
    from dpo_train.run.wandb_sink import run_id

    first = run_id(tmp_path, None)
    assert run_id(tmp_path, 2) == first
    assert run_id(tmp_path, None) != first
    monkeypatch.setenv("WANDB_RUN_ID", "chosen-id")
    assert run_id(tmp_path, 2) == "chosen-id" == json.loads((tmp_path / "wandb-run.json").read_text())["run_id"]


def test_report_to_wandb_without_the_package_is_a_config_error_before_training(
    small_dataset, smollm2_dir, tmp_path, run_cli, monkeypatch
):
    out = tmp_path / "run"
    config = tiny_config(small_dataset, smollm2_dir, out, max_steps=1, report_to=["wandb"])
    path = write_yaml(tmp_path / "c.yaml", config)
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if not installed
    result = train_here(run_cli, path, code=2)
    assert (
        "error: train.report_to lists wandb, but the wandb package is not installed; install it with "
        "`pip install 'dpo-toolkit[wandb]'`, or drop it from train.report_to" in result.stderr
    )
    assert "Traceback" not in result.stderr and not (out / "metrics.jsonl").exists()


def test_a_run_wandb_cannot_start_is_a_config_error_and_other_ranks_start_none(tmp_path, monkeypatch):
    """Online without an API key, wandb.init raises its UsageError: named, with the ways out. Ranks other
    than 0 never call wandb.init."""
    import wandb

    from dpo_train.errors import ConfigError
    from dpo_train.run.sinks import MetricSinks

    def init(**_):
        raise wandb.errors.UsageError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(wandb, "init", init)
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    (tmp_path / "config.resolved.yaml").write_text("train: {}\n")
    with MetricSinks(["wandb"], tmp_path, rank=1, resumed_at=None) as sinks:
        sinks.step({"step": 0, "loss": 0.5})
    with pytest.raises(ConfigError) as caught:
        MetricSinks(["wandb"], tmp_path, rank=0, resumed_at=None)
    assert str(caught.value) == (
        "train.report_to: wandb could not start a run (No API key configured. Use `wandb login` to log in.); log "
        "in (`wandb login` or WANDB_API_KEY), or set WANDB_MODE=offline to write the run under WANDB_DIR only "
        "(`wandb sync` uploads it later), or drop wandb from train.report_to"
    )


def test_a_file_where_the_wandb_directory_belongs_is_a_config_error(tmp_path, monkeypatch):
    from dpo_train.errors import ConfigError
    from dpo_train.run.sinks import check_sinks

    monkeypatch.delenv("WANDB_DIR", raising=False)
    (tmp_path / "wandb").write_text("not a directory")
    with pytest.raises(ConfigError) as caught:
        check_sinks(["wandb"], tmp_path)
    assert str(caught.value) == (
        f"train.report_to: wandb writes its run files into {tmp_path}/wandb, which is a file; move the file "
        "away, or set another train.output_dir"
    )
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))
    with pytest.raises(ConfigError, match="or set WANDB_DIR elsewhere$"):
        check_sinks(["wandb"], tmp_path / "elsewhere")
