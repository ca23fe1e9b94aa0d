"""A precomputed reference that no model could have computed is refused, and a sidecar is never replaced silently."""

from __future__ import annotations

import json
from types import SimpleNamespace

import numpy as np
import pytest

from dpo_data.dataset.store import PairStore
from dpo_train.errors import SidecarError
from dpo_train.reference.sidecar import SIDECAR_DOCUMENT, SIDECAR_TABLE, load_sidecar, write_sidecar
from tests.harness import train_here, write_yaml
from tests.tiny import tiny_llama

WEIGHTS = "sha256:" + "0" * 64


def _write(path, store, chosen, rejected):
    tokens = np.ones(store.num_pairs, dtype=np.float64)
    scores = SimpleNamespace(chosen=chosen, rejected=rejected, chosen_tokens=tokens, rejected_tokens=tokens)
    write_sidecar(path, scores, store, WEIGHTS, "fp32", "separate", "init")


@pytest.mark.parametrize("value, shown", [(float("nan"), "nan"), (float("inf"), "inf"), (0.5, "0.5")])
def test_a_table_with_values_no_model_computes_is_refused_though_its_hashes_match(
    small_dataset, tmp_path, value, shown
):
    """The hashes are rewritten by the same hand (write_sidecar), as someone who can write both would."""
    store = PairStore([str(small_dataset)])
    n = store.num_pairs
    chosen, rejected = -np.arange(1, n + 1, dtype=np.float64), -np.full(n, 2.0)
    _write(tmp_path / "ok", store, chosen, rejected)
    assert load_sidecar(tmp_path / "ok", store, WEIGHTS, "fp32", "separate").chosen.shape == (n,)
    chosen[3] = value
    _write(tmp_path / "bad", store, chosen, rejected)
    with pytest.raises(SidecarError, match=rf"chosen log-probs must be finite and <= 0; 1 are not \(pair 3: {shown}\)"):
        load_sidecar(tmp_path / "bad", store, WEIGHTS, "fp32", "separate")


def _precomputed_config(tmp_path, small_dataset, smollm2_dir, sidecar=None, **more):
    """A one-layer run on a precomputed reference at `sidecar` (tmp_path/sidecar); `more`: keys added to
    its sections, e.g. data={"pairs_per_step": 4}."""
    sidecar = sidecar or tmp_path / "sidecar"
    config = {
        "model": {
            "init": {
                "config": tiny_llama(hidden_size=16, intermediate_size=32, num_hidden_layers=1),
                "seed": 0,
            },
            "tokenizer": str(smollm2_dir),
        },
        "reference": {"mode": "precomputed", "path": str(sidecar)},
        "data": {"path": str(small_dataset)},
        "train": {"output_dir": str(tmp_path / "run")},
        "distributed": {"strategy": "ddp"},
    }
    for section, keys in more.items():
        config[section].update(keys)
    return write_yaml(tmp_path / "config.yaml", config), sidecar


def test_precompute_refuses_to_replace_a_sidecar_without_overwrite(small_dataset, smollm2_dir, tmp_path, run_cli):
    path, sidecar = _precomputed_config(tmp_path, small_dataset, smollm2_dir)
    train_here(run_cli, path, "--precompute-reference")
    written = (sidecar / SIDECAR_TABLE).read_bytes(), json.loads((sidecar / SIDECAR_DOCUMENT).read_text())
    again = train_here(run_cli, path, "--precompute-reference", code=2)
    assert f"reference.path {sidecar} already holds a sidecar" in again.output and "--overwrite" in again.output
    assert ((sidecar / SIDECAR_TABLE).read_bytes(), json.loads((sidecar / SIDECAR_DOCUMENT).read_text())) == written
    train_here(run_cli, path, "--precompute-reference", "--overwrite")
    stray = train_here(run_cli, path, "--overwrite", code=2)
    assert "--overwrite only applies to --precompute-reference" in stray.output


@pytest.mark.parametrize("edit", ["swap chosen and rejected", "half a nat off"])
def test_a_plausible_edit_with_rewritten_hashes_is_caught_at_the_first_step(
    small_dataset, smollm2_dir, tmp_path, run_cli, edit
):
    """Before the first step the policy is the reference, so the table must give its log-probs."""
    from safetensors.numpy import load_file

    path, sidecar = _precomputed_config(tmp_path, small_dataset, smollm2_dir)
    train_here(run_cli, path, "--precompute-reference")
    train_here(run_cli, path, "--set", "train.max_steps=1")  # the table as computed passes
    table = load_file(str(sidecar / SIDECAR_TABLE))
    document = json.loads((sidecar / SIDECAR_DOCUMENT).read_text())
    chosen, rejected = table["chosen"].copy(), table["rejected"].copy()
    if edit == "swap chosen and rejected":
        chosen, rejected = rejected, chosen
    else:
        chosen = chosen.copy()
        chosen[:] -= 0.5  # every pair half a nat less likely: plausible values, all finite and <= 0
    scores = SimpleNamespace(
        chosen=chosen, rejected=rejected, chosen_tokens=table["chosen_tokens"], rejected_tokens=table["rejected_tokens"]
    )
    store = PairStore([str(small_dataset)])
    ref = document["reference"]
    write_sidecar(sidecar, scores, store, ref["weights_fingerprint"], ref["precision"], ref["layout"], ref["source"])
    result = train_here(run_cli, path, "--set", "train.max_steps=1", "--set", "train.resume=never", code=2)
    assert "before the first step the policy is the reference, yet pair" in result.output
    assert "--precompute-reference --overwrite" in result.output


def test_a_weights_from_run_precomputes_its_own_reference_and_trains_on_it(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    """--precompute-reference starts from the run's initial policy, train.weights_from included: the
    sidecar is bound to those weights, so the run accepts it (before, it was bound to model.init's)."""
    path, sidecar = _precomputed_config(tmp_path, small_dataset, smollm2_dir)
    first = ["--set", "reference.mode=live", "--set", "train.max_steps=2", "--set", "train.save_every=2"]
    first += ["--set", f"train.output_dir={tmp_path / 'first'}"]
    train_here(run_cli, path, *first)
    later = ["--set", f"train.weights_from={tmp_path / 'first'}", "--set", f"train.output_dir={tmp_path / 'later'}"]
    train_here(run_cli, path, *later, "--precompute-reference")
    train_here(run_cli, path, *later, "--set", "train.max_steps=1")
    losses = [json.loads(line)["loss"] for line in (tmp_path / "later" / "metrics.jsonl").read_text().splitlines()]
    assert losses == [pytest.approx(0.6931471805599453, abs=1e-6)]  # the policy is its reference at step 0
