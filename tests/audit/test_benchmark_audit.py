"""benchmarks/audit.py --quick end to end as a process: a generated dataset audited, its planted findings found."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def test_the_audit_benchmark_smoke_runs(smollm2_dir, tmp_path):
    out = tmp_path / "audit.json"
    done = subprocess.run(
        [sys.executable, str(BENCHMARKS / "audit.py"), "--quick", "--work", str(tmp_path / "work"), "--json", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (row,) = json.loads(out.read_text())["rows"]
    assert row["pairs"] == 2000 and row["pairs_per_s"] > 0 and row["anon_peak_mib"] > 0
    assert row["exact_duplicates"] >= row["planted"]["exact"] > 0  # a swapped copy swapped back is one more
    assert row["conflicting_pairs"] > row["planted"]["swapped"] > 0  # each swap and its original
    assert "targets: none judged" in done.stdout
