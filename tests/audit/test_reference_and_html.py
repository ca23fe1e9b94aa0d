"""`dpo-data audit --reference SIDECAR` (a real precomputed sidecar of the planted dataset) and `--html OUT`."""

from __future__ import annotations

import json
import sys

import numpy as np
import pytest

from dpo_state.schema import schema_problems
from tests.harness import data_here, tiny_config, write_yaml


@pytest.fixture(scope="module")
def sidecar(planted, smollm2_dir, tmp_path_factory):
    """The tiny Llama's reference log-probs of every pair of `base`, by `dpo-train --precompute-reference`."""
    from click.testing import CliRunner

    from dpo_cli.train import main

    tmp = tmp_path_factory.mktemp("sidecar")
    config = tiny_config(planted.base, smollm2_dir, tmp / "run", max_steps=1)
    config["reference"] = {"mode": "precomputed", "path": str(tmp / "ref")}
    path = write_yaml(tmp / "c.yaml", config)
    result = CliRunner().invoke(main, [str(path), "--quiet", "--precompute-reference"], catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    return tmp / "ref"


def test_the_reference_margins_and_the_most_reversed_pairs_are_the_sidecars(planted, sidecar, run_cli):
    from safetensors.numpy import load_file

    doc = json.loads(
        data_here(run_cli, "audit", planted.base, "--reference", sidecar, "--json", "--reference-top", "5").stdout
    )
    assert schema_problems("audit", doc) == []
    table = load_file(str(sidecar / "logps.safetensors"))
    margin = table["chosen"] - table["rejected"]
    ref = doc["reference"]
    assert ref["margins"]["pairs"] == 46 and ref["unscored_pairs"] == 0
    assert ref["margins"]["fraction_negative"] == pytest.approx(float((margin < 0).mean()), abs=1e-6)
    expected = [int(i) for i in np.argsort(margin, kind="stable")[:5] if margin[i] < 0]
    assert [r["pair"] for r in ref["reversed"]] == expected
    assert ref["sources"]["base"]["pairs"] == 30 and ref["sources"]["degenerate"]["pairs"] == 16
    text = data_here(run_cli, "audit", planted.base, "--reference", sidecar).stdout
    assert "reference margins" in text and "most reversed (pair: margin, source)" in text


def test_a_sidecar_of_another_dataset_is_refused_by_name(planted, sidecar, run_cli):
    result = data_here(run_cli, "audit", planted.long, "--reference", sidecar, code=2)
    assert result.stderr.startswith(f"error: --reference {sidecar} was computed for dataset sha256:")  # at once


def test_html_draws_the_tables_and_distributions(planted, sidecar, run_cli, tmp_path):
    pytest.importorskip("matplotlib")
    page = tmp_path / "audit.html"
    data_here(run_cli, "audit", planted.base, "--html", page, "--reference", sidecar)
    text = page.read_text()
    assert text.count("data:image/png;base64,") == 3  # lengths, length bias, reference margins
    assert "<h2>per source</h2>" in text and "<td>degenerate</td>" in text
    assert "pairs the reference most prefers reversed" in text


def test_html_without_matplotlib_is_one_named_error(planted, run_cli, tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib raises ImportError
    result = data_here(run_cli, "audit", planted.base, "--html", tmp_path / "a.html", code=2)
    assert result.stderr.startswith("error: dpo-data audit --html draws with matplotlib, which is not installed")
