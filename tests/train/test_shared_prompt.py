"""The shared-prompt layout ([prompt][chosen][rejected], the prompt computed once per pair) end to end through
the CLI: precomputed reference, SIGKILL and resume, the sidecar bound to its layout, the checkpoint
recording it; the same first loss as the separate layout with fewer tokens per pair."""

from __future__ import annotations

import json

import pytest

from tests.harness import state_here, train_here
from tests.train.checkpoint.test_checkpoint import config, metrics, train


@pytest.mark.slow
def test_shared_prompt_trains_precomputes_and_resumes_exactly(small_dataset, smollm2_dir, tmp_path, run_cli):
    sidecar = tmp_path / "sidecar"
    shared = {"data__layout": "shared_prompt", "reference__mode": "precomputed", "reference__path": str(sidecar)}
    full_path, full = config(tmp_path, small_dataset, smollm2_dir, "full", **shared)
    train_here(run_cli, full_path, "--precompute-reference")  # in this process: no process boundary in it
    document = json.loads((sidecar / "reference.json").read_text())
    assert document["reference"]["layout"] == "shared_prompt"
    train(full_path)

    path, out = config(tmp_path, small_dataset, smollm2_dir, "cut", **shared)
    assert train(path, env={"DPO_TRAIN_KILL": "after-save:3"}, check=None).returncode != 0
    resumed = train(path)
    assert f"resumed from {out / 'checkpoints' / 'step-000003'}" in resumed.stderr
    assert metrics(out) == metrics(full)
    same = state_here(run_cli, "diff", full, out, "--values", code=None)
    assert same.exit_code == 0, same.stdout[-3000:]
    assert (
        json.loads(state_here(run_cli, "inspect", out, "--json").stdout)["identity"]["layout"]["layout"]
        == "shared_prompt"
    )

    separate_path, separate = config(
        tmp_path, small_dataset, smollm2_dir, "separate", reference__mode="precomputed", reference__path=str(sidecar)
    )
    # a sidecar of the shared layout for a separate run; this refusal and the separate layout's first step
    # run in this process (train_here): neither needs a process of its own
    refused = train_here(run_cli, separate_path, code=2)
    assert "layout: the sidecar was computed in the shared_prompt layout, data.layout is separate" in refused.stderr

    live_path, live = config(tmp_path, small_dataset, smollm2_dir, "live", train__max_steps=1)
    train_here(run_cli, live_path)
    first_separate, first_shared = metrics(live)[0], metrics(full)[0]
    assert first_shared["loss"] == pytest.approx(first_separate["loss"], abs=1e-6)  # log 2 before any update
    assert first_shared["logps/chosen"] == pytest.approx(first_separate["logps/chosen"], rel=1e-5)
    assert first_shared["pairs"] == first_separate["pairs"]
    assert first_shared["input_tokens"] < first_separate["input_tokens"]  # each prompt once


def test_a_layout_change_is_elastic_in_pairs_mode_only():
    from dpo_state.state import identity_mismatches

    def identity(batching: str, layout: str) -> dict:
        return {"layout": {"batching": batching, "layout": layout, "world_size": 1}}

    mismatches, elastic = identity_mismatches(identity("pairs", "separate"), identity("pairs", "shared_prompt"))
    assert (mismatches, elastic) == ([], ["layout.layout: checkpoint separate, this run shared_prompt"])
    mismatches, _ = identity_mismatches(identity("tokens", "separate"), identity("tokens", "shared_prompt"))
    assert mismatches == ["layout.layout: checkpoint separate, this run shared_prompt"]
