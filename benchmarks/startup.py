#!/usr/bin/env python
"""Start-up and exit: a 10-row `dpo-data build`, `dpo-state inspect` and a one-step `dpo-train` of a tiny model in
fresh processes, against `import torch`.

    python benchmarks/startup.py [--repeats 3] [--checkpoint STEP_DIR] [--other CHECKOUT]

Each command runs in a fresh interpreter, as a user runs it; the repeats are interleaved (torch baseline, build,
inspect, again) and the medians reported, with each command's ratio to `python -c "import torch"` measured in
the same run (issue 36: a 10-row build took 7-14 s, almost all of it importing torch and transformers for a
tokenizer; its target is under 2 s on an idle machine). Without --checkpoint, a one-step run of a tiny random
model writes one first (its time is not counted). With --other PATH, the build and inspect also run with
PYTHONPATH=PATH (another checkout, e.g. the commit before: its packages, and `dpo_cli` where the installed one is
not its), interleaved with this one's.

Output: a table, then one line `JSON {...}`.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

ROWS = 10


def _wall(argv: list[str], pythonpath: str | None = None) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of `python ARGV...` in a fresh process (with `pythonpath` as its
    PYTHONPATH); exits naming it when it fails. CPU seconds barely move with other jobs' load; wall does."""
    env = {**os.environ, **({"PYTHONPATH": pythonpath} if pythonpath else {})}
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    # from a directory of no checkout: `python -m` puts the working directory first on sys.path
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=env, cwd=tempfile.gettempdir())
    seconds, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode:
        raise harness.ChildFailed(" ".join(argv), proc.returncode, proc.stderr)
    return seconds, after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime


def _rows(work: Path) -> Path:
    """The first `ROWS` rows of the bundled sample's chat file."""
    lines = (harness.SAMPLE / "arith_chat.jsonl").read_text().splitlines()[:ROWS]
    path = work / "rows.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def _checkpoint(work: Path, tokenizer: str) -> Path:
    """One committed checkpoint of a one-step run of a tiny random Llama on the 10 rows."""
    _wall(["-m", "dpo_cli.train", str(_one_step(work, tokenizer, save_every=1)), "--quiet"])
    return work / "run" / "checkpoints" / "step-000001"


def _one_step(work: Path, tokenizer: str, **train) -> Path:
    """The config of a one-step run of a tiny random Llama on the 10 rows (built once, into WORK/data)."""
    data = work / "data"
    if not data.is_dir():
        _wall(["-m", "dpo_cli.data", "build", str(_rows(work)), "--tokenizer", tokenizer, "--out", str(data)])
    sys.path.insert(0, str(harness.ROOT))
    from tests.harness import tiny_config, write_yaml

    return write_yaml(work / "run.yaml", tiny_config(data, Path(tokenizer), work / "run", max_steps=1, **train))


def measure(repeats: int, checkpoint: str | None, other: str | None) -> dict:
    from dpo_train.model.bundled import materialize_smollm2

    tokenizer = str(materialize_smollm2())
    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        rows, step = _rows(work), Path(checkpoint) if checkpoint else _checkpoint(work, tokenizer)
        train = _one_step(work, tokenizer)
        commands = {
            "python -c 'import torch'": lambda i: ["-c", "import torch"],
            f"dpo-data build ({ROWS} rows)": lambda i: [
                *("-m", "dpo_cli.data", "build", str(rows), "--tokenizer", tokenizer),
                *("--out", str(work / f"out{i}")),
            ],
            "dpo-state inspect": lambda i: ["-m", "dpo_cli.state", "inspect", str(step)],
            "dpo-train (1 step, tiny model)": lambda i: [
                *("-m", "dpo_cli.train", str(train), "--quiet", "--set", f"train.output_dir={work / f'run{i}'}")
            ],
        }
        checkouts = {name: None for name in commands}
        if other:
            for name in list(commands)[1:]:
                commands[f"{name} (--other)"] = lambda i, argv=commands[name]: argv(i + repeats)
                checkouts[f"{name} (--other)"] = other
        times = {name: [] for name in commands}
        for i in range(repeats):
            for name, argv in commands.items():
                times[name].append(_wall(argv(i), checkouts[name]))
    return _summary(times, "python -c 'import torch'")


def _summary(times: dict[str, list[tuple[float, float]]], baseline: str) -> dict:
    """Per command: its runs, the medians of wall and CPU seconds, and each as a ratio to the baseline's."""
    medians = {name: [statistics.median(run[k] for run in runs) for k in (0, 1)] for name, runs in times.items()}
    wall, cpu = medians[baseline]
    return {
        name: {"runs": times[name], "wall": m[0], "cpu": m[1], "wall_ratio": m[0] / wall, "cpu_ratio": m[1] / cpu}
        for name, m in medians.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--checkpoint", default=None, help="A checkpoint step directory to inspect [default: one made].")
    p.add_argument("--other", default=None, help="Another checkout to time the build and inspect from too.")
    args = p.parse_args()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    results = measure(args.repeats, args.checkpoint, args.other)
    print(f"{'command':<40} {'wall s':>7} {'/ torch':>8} {'cpu s':>7} {'/ torch':>8}  wall runs")
    for name, r in results.items():
        runs = ", ".join(f"{wall:.2f}" for wall, _ in r["runs"])
        print(f"{name:<40} {r['wall']:>7.2f} {r['wall_ratio']:>8.2f} {r['cpu']:>7.2f} {r['cpu_ratio']:>8.2f}  {runs}")
    print("JSON " + json.dumps({"repeats": args.repeats, "load": os.getloadavg(), "results": results}))


if __name__ == "__main__":
    main()
