"""The benchmark scripts keep up with the code: what they import of the project exists, and the one way they
build a trainer trains (two scripts built it the pre-rooms way for two days, and crashed when run)."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

from tests.harness import tiny_config

ROOT = Path(__file__).resolve().parents[1]
BENCHMARKS = ROOT / "benchmarks"
PROJECT = {"dpo_data", "dpo_state", "dpo_train", "dpo_report", "dpo_cli"}


def _fallbacks(tree: ast.AST) -> set[int]:
    """Line numbers of imports in an `except` handler or an `else` branch: a script's way of running against an
    older checkout (attention_overhead.py times two commits), not what this checkout must have."""
    lines = set()
    for node in ast.walk(tree):
        branches = [node] if isinstance(node, ast.ExceptHandler) else node.orelse if isinstance(node, ast.If) else []
        for branch in branches:
            lines |= {n.lineno for n in ast.walk(branch) if isinstance(n, ast.ImportFrom)}
    return lines


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py")))
def test_what_a_benchmark_imports_of_the_project_exists(script):
    tree = ast.parse((BENCHMARKS / script).read_text())
    skipped, missing = _fallbacks(tree), []
    for node in ast.walk(tree):
        if not isinstance(node, ast.ImportFrom) or node.lineno in skipped:
            continue
        if not node.module or node.module.split(".")[0] not in PROJECT:
            continue
        module = importlib.import_module(node.module)
        for alias in node.names:
            if not hasattr(module, alias.name) and importlib.util.find_spec(f"{node.module}.{alias.name}") is None:
                missing.append(f"{node.module}.{alias.name} (line {node.lineno})")
    assert missing == []


def test_the_benchmarks_trainer_trains_a_step(small_dataset, smollm2_dir, tmp_path, monkeypatch):
    from dpo_data import DPOLoader
    from dpo_train.config.loading import load_config

    monkeypatch.syspath_prepend(str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location("benchmark_harness", BENCHMARKS / "harness.py")
    harness = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "benchmark_harness", harness)
    spec.loader.exec_module(harness)
    config = load_config(tiny_config(small_dataset, smollm2_dir, tmp_path / "run"))
    loader = DPOLoader(config.data.paths, config.data.loader_config(0, 1), pad_to_multiple_of=8)
    trainer = harness.cpu_trainer(config, loader.stream.store)
    times, batches = harness.timed_steps(trainer, loader, 0)
    assert len(times) == 1 and trainer.state.step == 1 and batches


@pytest.mark.parametrize("script", sorted(p.name for p in BENCHMARKS.glob("*.py") if p.name != "harness.py"))
def test_a_benchmark_builds_our_trainer_through_the_harness(script):
    """`harness.cpu_trainer` is the one place a benchmark builds dpo_train's Trainer (TRL's DPOTrainer aside), so
    that a change to how it is built is made, and tested above, once."""
    calls = [
        node.lineno
        for node in ast.walk(ast.parse((BENCHMARKS / script).read_text()))
        if isinstance(node, ast.Call) and getattr(node.func, "id", getattr(node.func, "attr", None)) == "Trainer"
    ]
    assert calls == []


@pytest.mark.slow
def test_the_gpu_benchmark_smoke_runs_on_the_cpu(smollm2_dir, tmp_path):
    """benchmarks/gpu_throughput.py end to end as a process, on the CPU with a tiny model: data, model, matmul
    peak, ours (one layout and path, live) and TRL's default each in their own process, the summary, the JSON.
    One pair a step: the tiny model's cost is its 49152-row head over the step's tokens, and the script's path is
    the same for one pair as for two (packing several pairs into a micro-batch is the trainer's tests' to prove)."""
    import json
    import subprocess

    out = tmp_path / "gpu.json"
    argv = ["--device", "cpu", "--tiny", "--pairs", "8", "--steps", "2", "--warmup", "1", "--pairs-per-step", "1"]
    argv += ["--budget", "4096", "--methods", "ours-separate-segments-live", "trl-default-live", "ours-separate-x-live"]
    argv += ["--work", str(tmp_path / "work"), "--json", str(out)]
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "gpu_throughput.py"), *argv], capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    summary = doc["summary"]
    assert 3e6 < summary["parameters"] < 4e6 and summary["timed_pairs"] == 1
    assert summary["table"]["ours-separate-x-live"]["refused"].startswith("model.attention x is not a value")
    for method in ("ours-separate-segments-live", "trl-default-live"):
        row = summary["table"][method]
        assert row["pairs_per_s"] > 0 and row["tokens_per_s"] > 0 and row["peak_mib"] > 0, row
        assert 0 < row["mfu_useful"] <= row["mfu_hardware"] < 1, row
        assert len(row["step_seconds"]) == 2 and row["warmup_s"] == row["step_seconds"][0]
    assert summary["ratios"]["ours-separate-segments-live / TRL default"] > 0
    assert all(not t["judged"] for t in summary["targets"].values())  # judged on CUDA only
    assert "| ours-separate-segments-live | segments |" in done.stdout
