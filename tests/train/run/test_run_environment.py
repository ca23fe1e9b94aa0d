"""Every run's process environment: host tensors in huge pages, transformers' hub kernels off
(dpo_train/run/environment.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpo_train.run.environment import HUB_KERNELS, HUGE_PAGES, set_run_environment
from tests.harness import tiny_config

ROOT = Path(__file__).resolve().parents[3]
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# Trains (or not) in a fresh process, then allocates 64 MiB and says how much of the process is in huge pages
# (c10 decides once, at the process's first large tensor, the model's: the last allocation shows that choice)
# and transformers' hub-kernel switch as a model loaded now would read it (YES when unset, its default).
AFTER = """
import json, os, sys, torch
if sys.argv[1] == "train":
    from dpo_train.config.loading import load_config
    from dpo_train.trainer import train
    train(load_config(json.loads(sys.argv[2])), progress=False)
else:
    torch.ones(16 << 20)  # a first large tensor outside any run
x = torch.ones(16 << 20)
huge = sum(int(line.split()[1]) for line in open("/proc/self/smaps") if line.startswith("AnonHugePages"))
print(json.dumps({"huge_kib": huge, "hub_kernels": os.environ.get("USE_HUB_KERNELS", "YES")}))
"""


def _after(*args: str, env: dict) -> dict:
    done = subprocess.run(
        [sys.executable, "-c", AFTER, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.mark.skipif(
    not THP_MODE.is_file() or "[madvise]" not in THP_MODE.read_text(),
    reason="needs Linux transparent huge pages in madvise mode (in `always` every large mapping gets them anyway)",
)
def test_a_run_keeps_large_tensors_in_huge_pages_and_the_models_own_code(small_dataset, smollm2_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in (HUGE_PAGES, HUB_KERNELS)}
    config = json.dumps(tiny_config(small_dataset, smollm2_dir, tmp_path / "out", max_steps=1))
    # the libraries' defaults, so that what the run shows is its own: 4 KiB pages, hub kernels on
    assert _after("none", env=env) == {"huge_kib": 0, "hub_kernels": "YES"}
    run = _after("train", config, env=env)
    assert run["huge_kib"] >= 32 << 10 and run["hub_kernels"] == "NO", run  # at least half the 64 MiB tensor
    theirs = _after("train", config, env={**env, HUGE_PAGES: "0", HUB_KERNELS: "YES"})  # the documented ways out
    assert theirs == {"huge_kib": 0, "hub_kernels": "YES"}


def test_a_users_own_settings_win(monkeypatch):
    monkeypatch.setenv(HUGE_PAGES, "0")
    monkeypatch.setenv(HUB_KERNELS, "YES")
    set_run_environment()
    assert (os.environ[HUGE_PAGES], os.environ[HUB_KERNELS]) == ("0", "YES")
    monkeypatch.delenv(HUGE_PAGES)
    monkeypatch.delenv(HUB_KERNELS)
    set_run_environment()
    assert (os.environ[HUGE_PAGES], os.environ[HUB_KERNELS]) == ("1", "NO")
