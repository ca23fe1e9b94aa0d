"""The run log, one owner: rank 0 writes metrics.jsonl every log_every steps and eval.jsonl, others nothing;
a resume drops the lines of steps to be trained again, a fresh start replaces an earlier run's logs."""

from __future__ import annotations

import types

import orjson

from dpo_state.run_logs import EVAL_LOG, METRICS_LOG
from dpo_train.config.sections import TrainConfig, TrainSection
from dpo_train.evaluation import EVAL_FORMAT_VERSION
from dpo_train.run.log import RunLog
from dpo_train.step.metrics import new_sums, step_record


def _step(step):
    """A schema-valid metrics record, as the trainer's step writes it."""
    return {**step_record(new_sums(1), ["train"], 1.0, 1e-5, step, 0.1, 1), "skipped_steps": 0}


def _eval(step):
    fields = ("accuracy", "ties", "rewards/margins", "logratio_margin", "logp_accuracy", "loss", "pair_loss", "nll")
    return {"format_version": EVAL_FORMAT_VERSION, "step": step, "pairs": 2, **dict.fromkeys(fields, 0.5)}


def _lines(path):
    return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []


def _write(out, rank=0, log_every=1, resumed_at=None, steps=range(4), evals=()):
    # what RunLog reads of a run: its output directory, this rank and the train section
    run = types.SimpleNamespace(out=out, rank=rank, config=TrainConfig(train=TrainSection(log_every=log_every)))
    with RunLog(run, resumed_at) as log:
        for step in steps:
            log.step(_step(step))
        for step in evals:
            log.evaluation(_eval(step))


def test_rank_zero_writes_every_log_every_steps_and_other_ranks_write_nothing(tmp_path):
    (tmp_path / "r1").mkdir()
    _write(tmp_path / "r1", rank=1, evals=(0,))
    assert list((tmp_path / "r1").iterdir()) == []
    _write(tmp_path, log_every=2, evals=(0, 4))
    assert [r["step"] for r in _lines(tmp_path / METRICS_LOG)] == [0, 2]
    assert [r["step"] for r in _lines(tmp_path / EVAL_LOG)] == [0, 4]


def test_a_resume_drops_the_steps_trained_again_and_a_torn_line(tmp_path):
    _write(tmp_path, steps=range(5), evals=(0, 2, 4))
    with open(tmp_path / METRICS_LOG, "ab") as f:
        f.write(b'{"step": 5, "lo')  # a crash mid-write
    _write(tmp_path, resumed_at=2, steps=range(2, 4), evals=(3,))
    assert [r["step"] for r in _lines(tmp_path / METRICS_LOG)] == [0, 1, 2, 3]
    assert [r["step"] for r in _lines(tmp_path / EVAL_LOG)] == [0, 2, 3]


def test_a_fresh_start_replaces_an_earlier_runs_logs_and_says_so(tmp_path, capsys):
    _write(tmp_path, steps=range(3), evals=(0,))
    capsys.readouterr()
    _write(tmp_path, steps=range(1))
    assert [r["step"] for r in _lines(tmp_path / METRICS_LOG)] == [0]
    assert not _lines(tmp_path / EVAL_LOG)
    assert "held logs of an earlier run without a checkpoint to resume; they are replaced" in capsys.readouterr().err


def test_an_eval_log_written_before_loss_existed_stays_readable(tmp_path):
    """format_version 1 records (no loss, nll) from a run started before them still resume; a version 2
    record without them is a named error."""
    import pytest

    from dpo_state.errors import DocumentError
    from dpo_state.run_logs import read_log

    old = {k: v for k, v in _eval(0).items() if k not in ("loss", "pair_loss", "nll")}
    first = {k: v for k, v in old.items() if k not in ("rewards/margins", "logratio_margin")}  # format 1's names
    (tmp_path / EVAL_LOG).write_bytes(orjson.dumps({**first, "format_version": 1, "margin": 0.5}) + b"\n")
    assert read_log(tmp_path / EVAL_LOG).records[0]["format_version"] == 1
    (tmp_path / EVAL_LOG).write_bytes(orjson.dumps(old) + b"\n")
    with pytest.raises(DocumentError, match="'loss' is a required property"):
        read_log(tmp_path / EVAL_LOG)


def _sums(pair_losses: dict, nll: float, chosen_tokens: int, aux: float):
    """Step sums by hand: per source its pair losses, the step's NLL sum and chosen tokens, and the router
    losses' pair-weighted sum."""
    from dpo_train.step.metrics import SUMS

    sums = new_sums(len(pair_losses))
    for row, losses in enumerate(pair_losses.values(), 1):
        for target in (0, row):
            sums[target, SUMS.index("loss")] += sum(losses)
            sums[target, SUMS.index("pairs")] += len(losses)
    sums[0, SUMS.index("nll")], sums[0, SUMS.index("chosen_tokens")] = nll, chosen_tokens
    sums[0, SUMS.index("aux_loss")], sums[0, SUMS.index("capacity")] = aux, 100
    return sums


def test_the_logged_loss_is_the_optimized_objective_and_its_parts_keep_their_names():
    """loss = pair_loss + w nll + c aux_loss, the value `microbatch_loss` sums to over the step (TRL logs
    its objective as loss): 4 pairs with losses 0.2, 0.4, 0.6 (source a) and 0.8 (b), NLL 30 over 10 chosen
    tokens, router losses 0.2 a pair; w 0.5, c 0.01: 0.5 + 0.5 * 3 + 0.01 * 0.2 = 2.002. Without the
    weights loss is the pair part; per source the pair part keeps its own name."""
    import pytest
    import torch

    from dpo_train.step.objective import microbatch_loss

    sums = _sums({"a": [0.2, 0.4, 0.6], "b": [0.8]}, nll=30.0, chosen_tokens=10, aux=0.8)
    record = step_record(sums, ["a", "b"], 1.0, 1e-5, 0, 0.1, 1, nll_weight=0.5, router_aux_coef=0.01)
    expected = microbatch_loss(
        torch.tensor([0.2, 0.4, 0.6, 0.8], dtype=torch.float64),
        4,
        torch.tensor(30.0, dtype=torch.float64),
        10,
        0.5,
        torch.tensor(0.2, dtype=torch.float64),
        0.01,
    )
    assert record["format_version"] == 3
    assert record["loss"] == pytest.approx(2.002, rel=1e-12) == pytest.approx(float(expected), rel=1e-12)
    assert (record["pair_loss"], record["nll"], record["aux_loss"]) == pytest.approx((0.5, 3.0, 0.2), rel=1e-12)
    assert record["sources"]["a"]["pair_loss"] == pytest.approx(0.4) and "loss" not in record["sources"]["a"]
    plain = step_record(sums, ["a", "b"], 1.0, 1e-5, 0, 0.1, 1)
    assert plain["loss"] == plain["pair_loss"] == pytest.approx(0.5) and "aux_loss" not in plain


def test_a_metrics_log_written_before_the_objective_was_logged_stays_readable(tmp_path):
    """Format 2 lines (loss: the pair part, no pair_loss) still read, so a run resumed across the change
    keeps its log; a format 3 line without pair_loss is a named error."""
    import pytest

    from dpo_state.errors import DocumentError
    from dpo_state.run_logs import read_log

    old = {k: v for k, v in _step(0).items() if k != "pair_loss"}
    lines = [{**old, "format_version": 2}, _step(1)]
    (tmp_path / METRICS_LOG).write_bytes(b"".join(orjson.dumps(r) + b"\n" for r in lines))
    assert [r["format_version"] for r in read_log(tmp_path / METRICS_LOG).records] == [2, 3]
    (tmp_path / METRICS_LOG).write_bytes(orjson.dumps({**old, "format_version": 3}) + b"\n")
    with pytest.raises(DocumentError, match="'pair_loss' is a required property"):
        read_log(tmp_path / METRICS_LOG)
