"""One error family: user errors from every layer end as a named message and exit code, bugs stay bugs."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest

from dpo_cli.data import main as dpo_data
from dpo_data.errors import DataError
from dpo_data.prepare.rows import RowReject, normalize_row
from dpo_data.prepare.tokenize import PairEncoder, TokenizeOptions
from tests.conftest import chat, write_jsonl


def _tokenizer_without_eos(smollm2_dir, tmp_path):
    out = tmp_path / "no-eos"
    out.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / name, out / name)
    config = json.loads((out / "tokenizer_config.json").read_text())
    config.pop("eos_token")
    config.pop("pad_token")
    (out / "tokenizer_config.json").write_text(json.dumps(config))
    return out


def test_a_tokenizer_without_eos_is_a_named_build_error_not_a_traceback(smollm2_dir, tmp_path, run_cli):
    """It used to raise a bare ValueError that `dpo-data build` did not catch."""
    tokenizer_dir = _tokenizer_without_eos(smollm2_dir, tmp_path)
    rows = write_jsonl(tmp_path / "t.jsonl", [{"prompt": "2+2=", "chosen": "4", "rejected": "5"}])
    r = run_cli(dpo_data, "build", rows, "--tokenizer", tokenizer_dir, "--out", tmp_path / "out")
    assert r.exit_code == 2
    assert "error: --tokenizer: the tokenizer has no eos_token" in r.output and "pass --no-eos" in r.output
    assert not (tmp_path / "out").exists()


def test_a_bug_while_rendering_is_raised_not_recorded_as_a_row_reject(tokenizer, monkeypatch):
    """Only a template's own errors are the row's fault; anything else is a bug and must surface."""
    from dpo_data.prepare.template import ChatRenderer

    def broken(self, messages, add_generation_prompt, tools=None):
        raise KeyError("a bug in our own code")

    monkeypatch.setattr(ChatRenderer, "render", broken)
    encoder = PairEncoder(tokenizer, TokenizeOptions())
    with pytest.raises(KeyError, match="a bug in our own code"):
        encoder.encode_many([normalize_row(chat("q", "x", "y"))])


def test_a_template_error_is_still_a_row_reject(tokenizer):
    import copy

    clone = copy.deepcopy(tokenizer)
    clone.chat_template = "{{ raise_exception('only one turn allowed') }}"
    (result,) = PairEncoder(clone, TokenizeOptions()).encode_many([normalize_row(chat("q", "x", "y"))])
    assert isinstance(result, RowReject) and result.reason == "template_error"


def test_a_pair_over_the_budget_is_the_same_data_error_in_the_loader_and_in_scoring(sample_dataset):
    from dpo_data import DPOLoader, LoaderConfig, PairStore
    from dpo_train.config.loading import load_config
    from dpo_train.logps import Scoring
    from dpo_train.parallel.device import placement
    from dpo_train.reference.scoring import score_pairs
    from dpo_train.run.setup import local_run

    with pytest.raises(DataError, match=r"more than max_tokens_per_microbatch 16.*never skipped or cut"):
        DPOLoader([sample_dataset], LoaderConfig(max_tokens_per_microbatch=16))
    store = PairStore([sample_dataset])
    assert int(store.segment_tokens(np.arange(store.num_pairs)).max()) > 16
    with pytest.raises(DataError, match=r"more than the micro-batch budget 16.*never skipped or cut"):
        run = local_run(load_config({"data": {"path": str(sample_dataset)}}), placement("cpu", "fp32"), store)
        score_pairs(model=None, scoring=Scoring(), store=store, run=run, max_tokens=16)


@pytest.mark.parametrize(
    "args, message",
    [
        (["inspect", "/nowhere/at/all"], "holds no committed checkpoint"),
        (["verify", "/nowhere/at/all"], "holds no committed checkpoint"),
    ],
)
def test_dpo_state_reports_user_errors_without_a_traceback(args, message, run_cli):
    from dpo_cli.state import main as dpo_state

    r = run_cli(dpo_state, *args)
    assert r.exit_code in (1, 2) and message in r.output and "Traceback" not in r.output
