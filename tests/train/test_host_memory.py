"""Every run's host tensors of 2 MiB or more in huge pages (dpo_train/run/host_memory.py)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from dpo_train.run.host_memory import HUGE_PAGES, use_huge_pages
from tests.harness import tiny_config

ROOT = Path(__file__).resolve().parents[2]
THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# Trains (or not) in a fresh process, then allocates 64 MiB and says how much of the process is in huge pages:
# c10 decides once, at the process's first large tensor (the model's), so the last allocation shows that choice.
AFTER = """
import json, sys, torch
if sys.argv[1] == "train":
    from dpo_train.config.loading import load_config
    from dpo_train.trainer import train
    train(load_config(json.loads(sys.argv[2])), progress=False)
else:
    torch.ones(16 << 20)  # a first large tensor outside any run
x = torch.ones(16 << 20)
print(sum(int(line.split()[1]) for line in open("/proc/self/smaps") if line.startswith("AnonHugePages")))
"""


def _huge_kib(*args: str, env: dict) -> int:
    done = subprocess.run(
        [sys.executable, "-c", AFTER, *args], capture_output=True, text=True, cwd=ROOT, env=env, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(
    not THP_MODE.is_file() or "[madvise]" not in THP_MODE.read_text(),
    reason="needs Linux transparent huge pages in madvise mode (in `always` every large mapping gets them anyway)",
)
def test_a_run_keeps_its_large_tensors_in_huge_pages(small_dataset, smollm2_dir, tmp_path):
    env = {k: v for k, v in os.environ.items() if k != HUGE_PAGES}
    config = json.dumps(tiny_config(small_dataset, smollm2_dir, tmp_path / "out", max_steps=1))
    assert _huge_kib("none", env=env) == 0  # torch's default: 4 KiB pages, so the run's huge pages are its own
    assert _huge_kib("train", config, env=env) >= 32 << 10  # at least half the 64 MiB tensor
    assert _huge_kib("train", config, env={**env, HUGE_PAGES: "0"}) == 0  # the documented way out


def test_a_users_own_setting_wins(monkeypatch):
    monkeypatch.setenv(HUGE_PAGES, "0")
    use_huge_pages()
    assert os.environ[HUGE_PAGES] == "0"
    monkeypatch.delenv(HUGE_PAGES)
    use_huge_pages()
    assert os.environ[HUGE_PAGES] == "1"
