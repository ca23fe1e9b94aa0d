"""The trainer end to end: metrics per step, export, and the same run on 1 process and on 2 (DDP, FSDP2)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys

import pytest
import torch
import yaml
from safetensors.torch import load_file

from tests.harness import TINY_LLAMA, invoke, rank_worker, spawn, state_here, train_here

CHUNK_SOME = 100
"""train.logits_budget_mib of the 2-process runs: this model's micro-batches of more than 106 scored positions go
through the chunked vocabulary head, the smaller ones through the model's own (issue 35: both under DDP and FSDP2,
against one process's own head)."""


def write_config(tmp_path, dataset, tokenizer_dir, out, strategy="fsdp", logits_budget_mib=None, mlp_tile_tokens=None):
    config = {
        "model": {
            "init": {
                "config": TINY_LLAMA,
                "seed": 0,
            },
            "tokenizer": str(tokenizer_dir),
        },
        "data": {"path": str(dataset), "batching": "pairs", "pairs_per_step": 8, "max_tokens_per_microbatch": 400},
        "optim": {"lr": 1.0e-3},
        "train": {
            "output_dir": str(out),
            "max_steps": 3,
            "logits_budget_mib": logits_budget_mib,
            "mlp_tile_tokens": mlp_tile_tokens,
        },
        "distributed": {"strategy": strategy},
        "eval": {"path": str(dataset)},
    }
    path = tmp_path / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run(config, *extra, code=0, env=None):
    args = [sys.executable, "-m", "dpo_cli.train", str(config), *extra]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=600, env=env)
    assert code is None or proc.returncode == code, proc.stderr[-3000:]  # None: any (a killed attempt)
    return proc


def metrics(out):
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def single(sample_dataset, smollm2_dir, tmp_path_factory):
    """The run of one process, not --quiet (its stderr kept), in this process: what the tests read of it (its
    lines on stderr, files and numbers) does not depend on a process of its own, and an interpreter start would
    be most of its cost. A progress line is printed to sys.stderr when it is written, which click's runner
    captures, so the lines are those a process of its own prints."""
    from dpo_cli.train import main

    tmp = tmp_path_factory.mktemp("train")
    out = tmp / "single"
    result = invoke(main, write_config(tmp, sample_dataset, smollm2_dir, out))
    assert result.exit_code == 0, result.stderr[-3000:]
    (out / "stderr.txt").write_text(result.stderr)
    return out


@pytest.mark.slow
def test_progress_is_a_line_per_step_in_logs_and_quiet_silences_it(
    single, sample_dataset, smollm2_dir, tmp_path, run_cli
):
    stderr = (single / "stderr.txt").read_text().splitlines()
    lines = [x for x in stderr if re.match(r"step \d+/", x)]
    assert [x.split()[1] for x in lines] == ["1/3", "2/3", "3/3"] and "pairs/s" in lines[0]
    assert any(re.fullmatch(r"step 1: first forward and backward \.\.\. \d+\.\d s", x) for x in stderr)
    assert all(re.search(r"elapsed \d:\d\d:\d\d  eta \d:\d\d:\d\d$", x) for x in lines), lines
    # every long stage says that it starts and when it is done (a log has no bar): one line, or two when
    # something was said in between
    for stage in (
        "eval: the reference scores the held-out set",
        "eval at step 3: the policy scores the held-out set",
        f"export {single / 'final'}",
    ):
        one_line = any(re.fullmatch(rf"{re.escape(stage)} \.\.\. \d+\.\d s", x) for x in stderr)
        two_lines = f"{stage} ..." in stderr and any(x.startswith(f"{stage}: done in ") for x in stderr)
        assert one_line or two_lines, stage
    # --quiet in this process: the progress line is printed to sys.stderr when it is written, which click's
    # runner captures, so a line would show here as in a process of its own
    config = write_config(tmp_path, sample_dataset, smollm2_dir, tmp_path / "q")
    quiet = train_here(run_cli, config, "--set", "train.max_steps=1")
    assert not [x for x in quiet.stderr.splitlines() if x.startswith(("step ", "eval", "checkpoint", "export"))]


@pytest.mark.slow
def test_a_run_writes_pair_weighted_metrics_and_a_loadable_policy(single):
    from transformers import AutoModelForCausalLM

    rows = metrics(single)
    assert [r["step"] for r in rows] == [0, 1, 2] and all(r["pairs"] == 8 for r in rows)
    assert rows[0]["loss"] == pytest.approx(0.693147, abs=1e-6)  # policy == reference at step 0
    for key in (
        "rewards/chosen",
        "rewards/rejected",
        "rewards/margins",
        "logps/chosen",
        "logps/rejected",
        "grad_norm",
        "lr",
        "input_tokens",
        "supervised_tokens",
        "packing_efficiency",
        "pairs/s",
        "tokens/s",
    ):
        assert key in rows[0]
    assert all(0.0 <= r["rewards/accuracies"] <= 1.0 for r in rows)
    for r in rows:  # the fill histogram counts the step's micro-batches holding pairs, each in its tenth
        assert len(r["fill_histogram"]) == 10 and sum(r["fill_histogram"]) == r["microbatches"] > 0
        low = sum(b / 10 * n for b, n in enumerate(r["fill_histogram"])) / r["microbatches"]
        assert low <= r["packing_efficiency"] <= low + 0.1
    for r in rows:  # per source, a pair counts once: the sources add up to the step
        assert sum(v["pairs"] for v in r["sources"].values()) == r["pairs"]
        assert sum(v["input_tokens"] for v in r["sources"].values()) == r["input_tokens"]
        assert sum(v["supervised_tokens"] for v in r["sources"].values()) == r["supervised_tokens"]
    assert AutoModelForCausalLM.from_pretrained(single / "final").config.hidden_size == 32
    assert (single / "config.resolved.yaml").is_file()


def two_ranks(config):
    """The run of `config` on 2 ranks, spawned (`rank_worker`): a reference the tests compare to, not a launch
    they check (the moved run below launches `--nproc-per-node 2` and ends bitwise equal to `two_ddp`)."""
    spawn(rank_worker, 2, [(str(config), False)])


@pytest.fixture(scope="module")
def two_ddp(sample_dataset, smollm2_dir, tmp_path_factory):
    """The `single` run on 2 processes (DDP), spawned (`two_ranks`)."""
    tmp = tmp_path_factory.mktemp("two")
    out = tmp / "two-ddp"
    two_ranks(write_config(tmp, sample_dataset, smollm2_dir, out, "ddp", CHUNK_SOME))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_two_processes_train_the_same_as_one(single, two_ddp, sample_dataset, smollm2_dir, tmp_path, strategy):
    out = two_ddp
    if strategy == "fsdp":  # and its MLPs in tiles (the reference rebuilt sharded, tiled alike): the same numbers
        out = tmp_path / "two-fsdp"
        config = write_config(tmp_path, sample_dataset, smollm2_dir, out, strategy, CHUNK_SOME, mlp_tile_tokens=64)
        two_ranks(config)
    assert {r["world_size"] for r in metrics(out)} == {2} and {r["world_size"] for r in metrics(single)} == {1}
    for a, b in zip(metrics(single), metrics(out)):
        assert a["pairs"] == b["pairs"] and a["input_tokens"] == b["input_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-5)  # the head's part reached every rank
    one, two = load_file(single / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 1e-4
    evals = [[json.loads(x) for x in (run / "eval.jsonl").read_text().splitlines()] for run in (single, out)]
    assert [e["step"] for e in evals[1]] == [0, 3] and evals[1][1]["pairs"] == 342  # scored across both ranks
    assert evals[1][1]["logratio_margin"] == pytest.approx(evals[0][1]["logratio_margin"], abs=1e-4)
    assert evals[1][1]["rewards/margins"] == pytest.approx(evals[0][1]["rewards/margins"], abs=1e-5)


TIMING = ("time", "pairs/s", "tokens/s")
SAVE_EVERY_STEP = ("--set", "train.save_every=1")  # no other effect on what is trained: the tests below show it
KILL_AFTER_STEP_1 = {"DPO_TRAIN_KILL": "after-save:1"}  # each rank SIGKILLs itself right after committing step 1


def two_nodes(config, *extra, env=None, node_env=None, node_cwd=None):
    """`dpo-train CONFIG --quiet --nnodes 2 --nproc-per-node 1` from two launchers on this machine, meeting at a
    c10d rendezvous on 127.0.0.1 as two machines would at the first one's address: their (exit code, stderr).
    `env` adds to both launchers' environment, `node_env` (node rank -> variables) to one's; `node_cwd` (node
    rank -> directory) sets one's working directory."""
    from tests.harness import free_port

    endpoint = f"127.0.0.1:{free_port()}"
    args = [sys.executable, "-m", "dpo_cli.train", str(config), "--quiet", *extra, "--nnodes", "2"]
    args += ["--rdzv-endpoint", endpoint, "--rdzv-id", "two-nodes"]
    nodes = [
        subprocess.Popen(
            [*args, "--node-rank", str(r)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **(env or {}), **(node_env or {}).get(r, {})},
            cwd=(node_cwd or {}).get(r),
            start_new_session=True,  # a launcher and its torchrun stop together (the finally below)
        )
        for r in (0, 1)
    ]
    try:
        stderr = [node.communicate(timeout=600)[1] for node in nodes]
        return [(node.returncode, err) for node, err in zip(nodes, stderr)]
    finally:
        for node in nodes:
            if node.poll() is None:  # one launcher failed, the other waits on a rendezvous that never completes
                os.killpg(node.pid, signal.SIGTERM)
                node.wait()


def assert_trained_alike(out, expected):
    """The same metrics (timing aside) and bitwise the same final weights as the run in `expected`."""
    assert [{k: v for k, v in r.items() if k not in TIMING} for r in metrics(out)] == [
        {k: v for k, v in r.items() if k not in TIMING} for r in metrics(expected)
    ]
    one, two = load_file(expected / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert one.keys() == two.keys() and all(torch.equal(one[k], two[k]) for k in one)


def committed_step(run_cli, out):
    return json.loads(state_here(run_cli, "inspect", out, "--json").stdout)["step"]


@pytest.mark.slow
def test_a_run_moved_between_two_nodes_and_one_launcher_of_two_processes_trains_the_uninterrupted_run(
    two_ddp, sample_dataset, smollm2_dir, tmp_path, run_cli
):
    """One run, world 2 throughout, moved twice: started by two launchers, `--nnodes 2 --nproc-per-node 1`, and
    killed right after committing step 1; resumed by one launcher of two processes (`--nproc-per-node 2`) and
    killed right after committing step 2; resumed on 2 nodes again to the end. The world size never changes, so
    each resume is exact, not elastic, and the run ends with the metrics (timing aside) and bitwise the weights
    of `two_ddp`, the uninterrupted run of 2 ranks on one node. So two nodes on localhost train what one node of
    two processes trains, from the start (steps 0 and 1) to the end and the export (step 2), and each layout
    resumes what the other committed. (These were three tests: two nodes start to end, then each move alone,
    killed and resumed: 5 launches for what these 3 prove.) The step-1 checkpoint resumed by 1 process is an
    elastic resume (world size 2 to 1), as docs/checkpoints.md says: the same pairs each step."""
    out = tmp_path / "cut"
    config = write_config(tmp_path, sample_dataset, smollm2_dir, out, "ddp", CHUNK_SOME)
    killed = two_nodes(config, *SAVE_EVERY_STEP, env=KILL_AFTER_STEP_1)
    assert all(code != 0 for code, _ in killed) and committed_step(run_cli, out) == 1
    elastic = tmp_path / "elastic"
    shutil.copytree(out, elastic)
    kill = {**os.environ, "DPO_TRAIN_KILL": "after-save:2"}
    moved = run(config, *SAVE_EVERY_STEP, "--quiet", "--nproc-per-node", "2", code=None, env=kill)
    assert moved.returncode != 0 and committed_step(run_cli, out) == 2
    assert f"resumed from {out / 'checkpoints' / 'step-000001'} at step 1" in moved.stderr
    assert "elastic resume" not in moved.stderr
    resumed = two_nodes(config, *SAVE_EVERY_STEP)
    assert [code for code, _ in resumed] == [0, 0], [err[-2000:] for _, err in resumed]
    stderr = "".join(err for _, err in resumed)  # rank 0 is on either launcher: c10d orders the nodes itself
    assert f"resumed from {out / 'checkpoints' / 'step-000002'} at step 2" in stderr and "elastic resume" not in stderr
    assert {r["world_size"] for r in metrics(out)} == {2}
    assert_trained_alike(out, two_ddp)
    one = write_config(tmp_path, sample_dataset, smollm2_dir, elastic, "ddp", CHUNK_SOME)
    alone = train_here(run_cli, one, *SAVE_EVERY_STEP).stderr
    assert "elastic resume (layout.world_size: checkpoint 2, this run 1)" in alone and "at step 1" in alone
    assert [r["world_size"] for r in metrics(elastic)] == [2, 1, 1]
    for a, b in zip(metrics(two_ddp), metrics(elastic)):
        assert (a["step"], a["pairs"], a["input_tokens"]) == (b["step"], b["pairs"], b["input_tokens"])
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-5, abs=1e-6)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--nnodes", "2"], "--nnodes 2 needs --rdzv-endpoint HOST:PORT"),
        (["--nnodes", "2", "--rdzv-endpoint", "h:1", "--node-rank", "2"], "--node-rank is 2; allowed: 0 to 1"),
        (["--nnodes", "0"], "--nnodes is 0; allowed: 1 or more"),
        (["--node-rank", "1"], "--rdzv-endpoint and --node-rank are for --nnodes 2 or more"),
    ],
)
def test_a_bad_node_layout_is_refused_before_torchrun_starts(args, message, tmp_path, run_cli):
    from dpo_cli.train import main

    path = tmp_path / "c.yaml"
    path.write_text("data: {path: x}\n")
    result = run_cli(main, str(path), *args)
    assert result.exit_code == 2 and f"error: {message}" in result.stderr


def test_a_config_error_exits_2_naming_the_key(tmp_path, run_cli):
    """In this process (run_cli): the exit code is the one `main` exits with, as in a process of its own."""
    from dpo_cli.train import main

    path = tmp_path / "bad.yaml"
    path.write_text("optim: {lrr: 1.0e-5}\n")
    result = run_cli(main, path)
    assert result.exit_code == 2 and "unknown key optim.lrr (did you mean 'lr'?)" in result.stderr


@pytest.mark.parametrize(
    "override, message",
    [
        ("data.path=''", "data.path is empty"),
        ("reference.mode=precomputed", "reference.path is empty"),
        ("reference.mode=none", "needs a reference"),
    ],
)
def test_settings_that_cannot_work_fail_before_anything_starts(tmp_path, override, message, run_cli):
    """In this process (run_cli), as the bad node layouts above: a refusal needs no process of its own."""
    from dpo_cli.train import main

    path = tmp_path / "c.yaml"
    path.write_text("model: {path: /nowhere}\n")
    result = run_cli(main, path, "--set", override)
    assert result.exit_code == 2 and message in result.stderr


@pytest.mark.slow
def test_a_failing_rank_stops_every_rank_with_its_error_named(sample_dataset, smollm2_dir, tmp_path):
    import time

    config = write_config(tmp_path, sample_dataset, smollm2_dir, tmp_path / "fail", "ddp")
    started = time.monotonic()
    proc = run(config, "--nproc-per-node", "2", code=1, env={**os.environ, "DPO_TRAIN_FAULT": "1:1"})
    assert time.monotonic() - started < 120  # no hang: the healthy rank, blocked in a collective, is stopped
    assert "rank 1: OSError: injected fault" in proc.stderr and "a rank failed" in proc.stderr
    assert len((tmp_path / "fail" / "metrics.jsonl").read_text().splitlines()) == 1  # step 0 finished, step 1 not


@pytest.fixture(scope="module")
def sidecar(sample_dataset, smollm2_dir, tmp_path_factory):
    """The initial policy's reference sidecar for the sample, precomputed once, in this process (no process
    boundary in it); a test that alters it copies it."""
    tmp = tmp_path_factory.mktemp("sidecar")
    config = write_config(tmp, sample_dataset, smollm2_dir, tmp / "pre")
    path = tmp / "sidecar"
    ref = ("--set", "reference.mode=precomputed", "--set", f"reference.path={path}")
    assert "reference sidecar written" in train_here(invoke, config, "--precompute-reference", *ref).stdout
    return path


@pytest.mark.slow
def test_a_precomputed_reference_trains_like_the_live_one(
    single, sidecar, sample_dataset, smollm2_dir, tmp_path, run_cli
):
    """Both runs and the sidecar in this process: no process boundary in what is compared."""
    out = tmp_path / "pre"
    config = write_config(tmp_path, sample_dataset, smollm2_dir, out)
    ref = ["--set", "reference.mode=precomputed", "--set", f"reference.path={sidecar}"]
    document = json.loads((sidecar / "reference.json").read_text())
    assert document["dataset"]["num_pairs"] == 342 and document["reference"]["precision"] == "fp32"
    train_here(run_cli, config, *ref)
    for a, b in zip(metrics(single), metrics(out)):
        assert b["loss"] == pytest.approx(a["loss"], abs=1e-6)
        assert b["rewards/margins"] == pytest.approx(a["rewards/margins"], abs=1e-5)
    one, two = load_file(single / "final" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    assert max(float((one[k] - two[k]).abs().max()) for k in one) < 1e-4  # AdamW, lr 1e-3, as across world sizes
    before, after = [json.loads(x) for x in (out / "eval.jsonl").read_text().splitlines()]
    assert (before["step"], before["accuracy"], before["ties"]) == (0, 0.0, 1.0)  # policy = reference: all ties
    assert after["step"] == 3 and after["ties"] < 0.05 and after["pairs"] == 342


@pytest.mark.slow
def test_a_sidecar_bound_to_other_weights_or_data_or_altered_is_refused(
    sidecar, sample_dataset, smollm2_dir, tmp_path, run_cli
):
    """Refusals before training, in this process (train_here): they need no process of their own."""
    config = write_config(tmp_path, sample_dataset, smollm2_dir, tmp_path / "r")
    altered = shutil.copytree(sidecar, tmp_path / "sidecar")
    ref = ["--set", "reference.mode=precomputed", "--set", f"reference.path={altered}", "--set", "train.max_steps=1"]
    other_weights = train_here(
        run_cli,
        config,
        *ref,
        "--set",
        "model.init={config: {model_type: llama, vocab_size: 49152, "
        "hidden_size: 32, intermediate_size: 64, num_hidden_layers: 2, num_attention_heads: 2, "
        "num_key_value_heads: 2}, seed: 1}",
        code=2,
    )
    assert "reference weights: the sidecar was computed with" in other_weights.stderr
    assert "--precompute-reference" in other_weights.stderr
    bf16 = train_here(run_cli, config, *ref, "--set", "train.precision=bf16", code=2)
    assert "precision: the sidecar was computed in fp32, this run uses bf16" in bf16.stderr
    table = altered / "logps.safetensors"
    data = bytearray(table.read_bytes())
    data[-3] ^= 1
    table.write_bytes(bytes(data))
    assert "sha256 differs from reference.json" in train_here(run_cli, config, *ref, code=2).stderr
    (altered / "reference.json").write_text("{not json")
    assert "is not valid JSON" in train_here(run_cli, config, *ref, code=2).stderr
