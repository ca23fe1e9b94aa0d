#!/usr/bin/env python
"""Throughput of `dpo-data build` against TRL 1.16's own DPO dataset preparation and a tokenizer floor.

    python benchmarks/build_throughput.py [--pairs 20000] [--procs 1 2] [--repeat 3]

One run generates N conversational explicit-prompt pairs (TRL field names) deterministically into a
temporary JSONL file and measures, for the same rows, at each process count:

  ours   dpo_data.prepare.build.build(...): read, validate, render, tokenize, check prefix stability at
         token level, write Arrow shards + rejects + manifest (fsynced), commit the directory.
  trl    TRL's real `DPOTrainer._prepare_dataset` (called on an instance from
         `DPOTrainer.__new__`) on a `datasets.Dataset` built from the same rows, with
         `dataset_num_proc` = N and `datasets.disable_caching()`.
  floor  render the three chat templates per row (prompt with generation prompt, prompt+chosen,
         prompt+rejected; tokenize=False), cut the completion texts off the prompt text, and
         batch-encode prompt + completion texts with the Rust fast tokenizer (1024 rows per batch);
         no checks, no output.
         At N > 1 the rows are split across a fork Pool of N that inherits rows and tokenizer.
  parts  `build --part K/P` for K = 0..P-1 (`--parts P`), one after the other (each as one task of a job
         array would run it on its own machine), then `merge`: its time is the critical path on P
         machines, the slowest part plus the merge; the sum of the parts is the work all tasks did
         (every part reads every row). Checked: the merged fingerprint is ours's.

    python benchmarks/build_throughput.py --methods ours parts --parts 4 --pairs-per-shard 500 --procs 1

Every timed run starts from the JSONL file and a tokenizer directory: loading the tokenizer and
parsing the file are inside the timing for all three (`build` cannot skip either). Each measurement
runs in a fresh Python process (imports and a 64-row warm-up of the same method done before the clock
starts), so no method inherits another's warmed state; repeats are interleaved across methods and the
median wall time is reported. Tokens = prompt + chosen + rejected tokens of the method's own output.

Output: a table, then one line `JSON {...}` with every measurement.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import harness

METHODS = ("ours", "trl", "floor", "parts")
WARMUP_ROWS = 64
FLOOR_BATCH_ROWS = 1024  # rows per encode_batch_fast call of the floor

# -- one measurement (runs in a fresh child process) ----------------------------------------------


def _read_jsonl(path: str) -> list[dict]:
    import orjson

    with open(path, "rb") as f:
        return [orjson.loads(line) for line in f if line.strip()]


_settings = {"parts": 4, "pairs_per_shard": 100_000}  # --parts and --pairs-per-shard, set in the child


def run_ours(data: str, tokenizer_dir: str, num_proc: int, work: Path) -> dict:
    from dpo_data.prepare.build import BuildOptions, build

    out = work / f"ours-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    options = BuildOptions(num_proc=num_proc, overwrite=True, pairs_per_shard=_settings["pairs_per_shard"])
    result = build([data], tokenizer_dir, out, options)
    seconds = time.perf_counter() - t0
    if result.error or result.manifest is None:
        raise SystemExit(f"build failed: {result.error}")
    totals = result.manifest["totals"]
    return {
        "seconds": seconds,
        "pairs": result.pairs,
        "rows": result.rows_read,
        "rejected": result.rejected,
        "tokens": totals["prompt_tokens"] + totals["completion_tokens"],
        "prompt_tokens": totals["prompt_tokens"],
        "completion_tokens": totals["completion_tokens"],
        "build_seconds": result.seconds,
        "fingerprint": result.manifest["fingerprint"],
    }


def run_parts(data: str, tokenizer_dir: str, num_proc: int, work: Path) -> dict:
    from dpo_data.prepare.build import BuildOptions, build
    from dpo_data.prepare.merge import merge
    from dpo_data.prepare.parts import Part

    root, count = work / f"parts-{time.monotonic_ns()}", _settings["parts"]
    part_seconds = []
    for k in range(count):
        t0 = time.perf_counter()
        options = BuildOptions(num_proc=num_proc, pairs_per_shard=_settings["pairs_per_shard"], part=Part(k, count))
        if build([data], tokenizer_dir, root / f"part-{k}", options).part is None:
            raise SystemExit(f"part {k}/{count} failed")
        part_seconds.append(time.perf_counter() - t0)
    t0 = time.perf_counter()
    result = merge([root / f"part-{k}" for k in range(count)], root / "ds")
    merge_seconds = time.perf_counter() - t0
    if result.error or result.manifest is None:
        raise SystemExit(f"merge failed: {result.error}")
    totals = result.manifest["totals"]
    return {
        "seconds": max(part_seconds) + merge_seconds,
        "pairs": result.pairs,
        "rows": result.rows_read,
        "tokens": totals["prompt_tokens"] + totals["completion_tokens"],
        "prompt_tokens": totals["prompt_tokens"],
        "completion_tokens": totals["completion_tokens"],
        "fingerprint": result.manifest["fingerprint"],
        "phases": {"slowest_part": max(part_seconds), "all_parts": sum(part_seconds), "merge": merge_seconds},
    }


def run_trl(data: str, tokenizer_dir: str, num_proc: int, work: Path) -> dict:
    import datasets
    import pyarrow.compute as pc
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    datasets.disable_caching()
    datasets.logging.disable_progress_bar()
    # max_length=None: the same work as `build` with its default (no length bound). TRL's default
    # (1024) would add a filter pass over the dataset, slowing TRL down; we do not count that.
    args = DPOConfig(
        output_dir=str(work / "trl-out"), dataset_num_proc=num_proc, max_length=None, report_to=[], use_cpu=True
    )
    t0 = time.perf_counter()
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    t1 = time.perf_counter()
    dataset = datasets.Dataset.from_list(_read_jsonl(data))
    t2 = time.perf_counter()
    trainer = DPOTrainer.__new__(DPOTrainer)  # only what `_prepare_dataset` reads
    trainer._tokenizer = tokenizer
    prepared = trainer._prepare_dataset(dataset, tokenizer, args, "train")
    t3 = time.perf_counter()
    counts = {
        c: int(pc.sum(pc.list_value_length(prepared.data.column(c))).as_py())
        for c in ("prompt_ids", "chosen_ids", "rejected_ids")
    }
    return {
        "seconds": t3 - t0,
        "pairs": len(prepared),
        "rows": len(dataset),
        "tokens": sum(counts.values()),
        "prompt_tokens": counts["prompt_ids"],
        "completion_tokens": counts["chosen_ids"] + counts["rejected_ids"],
        "phases": {"load_tokenizer": t1 - t0, "read_rows": t2 - t1, "prepare_dataset": t3 - t2},
    }


_floor: dict = {}


def _floor_encode(bounds: tuple[int, int]) -> tuple[int, int, int]:
    """Render and encode rows[start:stop] of the inherited rows; return (pairs, prompt, completion tokens)."""
    tokenizer, rows = _floor["tokenizer"], _floor["rows"]
    start, stop = bounds
    prompt_tokens = completion_tokens = 0
    # In batches: one encode_batch_fast over all rows at once is slower (memory) than bounded batches.
    for batch in range(start, stop, FLOOR_BATCH_ROWS):
        texts: list[str] = []
        for row in rows[batch : min(batch + FLOOR_BATCH_ROWS, stop)]:
            prompt = tokenizer.apply_chat_template(row["prompt"], tokenize=False, add_generation_prompt=True)
            chosen = tokenizer.apply_chat_template(row["prompt"] + row["chosen"], tokenize=False)
            rejected = tokenizer.apply_chat_template(row["prompt"] + row["rejected"], tokenize=False)
            texts += (prompt, chosen[len(prompt) :], rejected[len(prompt) :])
        lengths = [len(e.ids) for e in tokenizer.backend_tokenizer.encode_batch_fast(texts, add_special_tokens=False)]
        prompt_tokens += sum(lengths[0::3])
        completion_tokens += sum(lengths[1::3]) + sum(lengths[2::3])
    return stop - start, prompt_tokens, completion_tokens


def run_floor(data: str, tokenizer_dir: str, num_proc: int, work: Path) -> dict:
    import multiprocessing

    from transformers import AutoTokenizer

    t0 = time.perf_counter()
    _floor["tokenizer"] = AutoTokenizer.from_pretrained(tokenizer_dir)
    t1 = time.perf_counter()
    rows = _floor["rows"] = _read_jsonl(data)
    t2 = time.perf_counter()
    n = len(rows)
    if num_proc == 1:
        parts = [_floor_encode((0, n))]
    else:
        cuts = [n * k // num_proc for k in range(num_proc + 1)]
        with multiprocessing.get_context("fork").Pool(num_proc) as pool:
            parts = pool.map(_floor_encode, list(zip(cuts, cuts[1:])), chunksize=1)
    t3 = time.perf_counter()
    _floor.clear()
    pairs, prompt, completion = (sum(p[i] for p in parts) for i in range(3))
    return {
        "seconds": t3 - t0,
        "pairs": pairs,
        "rows": n,
        "tokens": prompt + completion,
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "phases": {"load_tokenizer": t1 - t0, "read_rows": t2 - t1, "render_encode": t3 - t2},
    }


RUNNERS = {"ours": run_ours, "trl": run_trl, "floor": run_floor, "parts": run_parts}


def measure_child(method: str, num_proc: int, data: str, warmup: str, tokenizer_dir: str, settings: dict) -> dict:
    """Warm up (imports, template compile, page cache) on a few rows, then time the full run once."""
    import logging

    import datasets  # noqa: F401 - imported outside the clock, as below
    import trl.trainer.dpo_trainer  # noqa: F401 - imported outside the clock, as below
    from transformers.utils import logging as hf_logging

    import dpo_data.prepare.build  # noqa: F401 - imports outside the clock, for every method alike

    _settings.update(settings)
    hf_logging.set_verbosity_error()
    logging.getLogger("trl").setLevel(logging.ERROR)
    with tempfile.TemporaryDirectory(prefix=f"bench-{method}-") as tmp:
        work = Path(tmp)
        RUNNERS[method](warmup, tokenizer_dir, num_proc, work)
        busy0, before = _machine_busy(), os.times()
        result = RUNNERS[method](data, tokenizer_dir, num_proc, work)
        busy1, after = _machine_busy(), os.times()
    # CPU seconds of this process and of its reaped children (pool workers), over the timed run.
    result["cpu_seconds"] = sum(after[i] - before[i] for i in range(4))
    # Cores kept busy by everything else on the machine meanwhile (other users' jobs): a noise flag.
    if busy0 is not None and busy1 is not None:
        elapsed = after.elapsed - before.elapsed
        result["other_load"] = max(0.0, (busy1 - busy0 - result["cpu_seconds"]) / max(elapsed, 1e-9))
    result.update(method=method, num_proc=num_proc)
    return result


def _machine_busy() -> float | None:
    """CPU seconds all cores have spent busy since boot (Linux /proc/stat), or None elsewhere."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()[1:]
        user, nice, system, _idle, _iowait, irq, softirq, steal = (int(x) for x in fields[:8])
        return (user + nice + system + irq + softirq + steal) / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError):
        return None


def _wait_quiet(max_wait: float, threshold: float = 0.3) -> None:
    """Wait (at most max_wait seconds) until other jobs keep fewer than `threshold` cores busy."""
    deadline = time.monotonic() + max_wait
    while True:
        b0, t0 = _machine_busy(), time.monotonic()
        time.sleep(1.0)
        b1, t1 = _machine_busy(), time.monotonic()
        if b0 is None or b1 is None or (b1 - b0) / (t1 - t0) < threshold or time.monotonic() > deadline:
            return
        time.sleep(2.0)


# -- driver ---------------------------------------------------------------------------------------


def _spawn(method: str, num_proc: int, data: Path, warmup: Path, tokenizer_dir: str, args) -> dict:
    # threads off: the Rust tokenizer's thread pool off, one core per process for every method
    env = {"TOKENIZERS_PARALLELISM": "false"} if args.tokenizer_threads == "off" else {}
    settings = {"parts": args.parts, "pairs_per_shard": args.pairs_per_shard}
    return harness.call(measure_child, method, num_proc, str(data), str(warmup), tokenizer_dir, settings, env=env)


def _summarize(runs: list[dict]) -> dict:
    seconds = [r["seconds"] for r in runs]
    med = statistics.median(seconds)
    first = runs[0]
    return {
        "median_seconds": med,
        "min_seconds": min(seconds),
        "max_seconds": max(seconds),
        "seconds": seconds,
        "pairs": first["pairs"],
        "tokens": first["tokens"],
        "prompt_tokens": first["prompt_tokens"],
        "completion_tokens": first["completion_tokens"],
        "pairs_per_s": first["pairs"] / med,
        "tokens_per_s": first["tokens"] / med,
        "cpu_seconds_median": statistics.median(r["cpu_seconds"] for r in runs),
        "other_load": [round(r["other_load"], 2) for r in runs if "other_load" in r],
        "discarded": sum(r.get("discarded_before", 0) for r in runs),
        "phases_median": {k: statistics.median(r["phases"][k] for r in runs) for k in first.get("phases", {})},
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--pairs", type=int, default=20_000, help="rows to generate (default 20000)")
    parser.add_argument("--procs", type=int, nargs="+", default=[1, 2], help="process counts (default 1 2)")
    parser.add_argument("--repeat", type=int, default=3, help="measurements per method and process count; median")
    parser.add_argument("--seed", type=int, default=1234, help="data seed (default 1234)")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=["ours", "trl", "floor"])
    parser.add_argument("--parts", type=int, default=4, help="parts of the 'parts' method (default 4)")
    parser.add_argument(
        "--pairs-per-shard", type=int, default=100_000, help="rows per span for ours and parts (default 100000)"
    )
    parser.add_argument("--tokenizer", default=None, help="tokenizer directory (default: SmolLM2-135M-Instruct)")
    parser.add_argument(
        "--tokenizer-threads",
        choices=["default", "off"],
        default="default",
        help="'off' sets TOKENIZERS_PARALLELISM=false for every method, so no process uses the "
        "Rust tokenizer's thread pool (batch encodes use ~1.5 cores per process otherwise)",
    )
    parser.add_argument(
        "--wait-quiet",
        type=float,
        default=120.0,
        metavar="S",
        help="before each measurement wait up to S seconds for other jobs to leave the cores idle "
        "(default 120; 0 disables)",
    )
    parser.add_argument(
        "--max-other-load",
        type=float,
        default=0.3,
        metavar="CORES",
        help="discard and redo a measurement during which other jobs kept more cores busy (default 0.3)",
    )
    parser.add_argument("--retries", type=int, default=3, help="redos per measurement at most (default 3)")
    parser.add_argument("--json-out", default=None, help="also write the JSON summary to this file")
    args = parser.parse_args(argv)

    if args.tokenizer is None:
        from dpo_train.model.bundled import materialize_smollm2

        args.tokenizer = str(materialize_smollm2())
    with tempfile.TemporaryDirectory(prefix="dpo-bench-") as tmp:
        data, warmup = Path(tmp) / "pairs.jsonl", Path(tmp) / "warmup.jsonl"
        t = time.perf_counter()
        harness.write_rows(data, args.pairs, args.seed)
        harness.write_rows(warmup, WARMUP_ROWS, args.seed + 1)
        print(
            f"generated {args.pairs} pairs ({data.stat().st_size / 1e6:.1f} MB, seed {args.seed}) "
            f"in {time.perf_counter() - t:.1f} s",
            file=sys.stderr,
        )
        runs: dict[tuple[str, int], list[dict]] = {}
        for rep in range(args.repeat):  # interleaved, so slow phases of a noisy machine hit every method
            for num_proc in args.procs:
                for method in args.methods:
                    for attempt in range(args.retries + 1):
                        _wait_quiet(args.wait_quiet, args.max_other_load)
                        r = _spawn(method, num_proc, data, warmup, args.tokenizer, args)
                        if r.get("other_load", 0.0) <= args.max_other_load or attempt == args.retries:
                            break
                        print(
                            f"[{rep + 1}/{args.repeat}] {method:5s} num_proc={num_proc}: "
                            f"discarded {r['seconds']:.2f} s, "
                            f"other jobs kept {r['other_load']:.2f} cores busy; again",
                            file=sys.stderr,
                        )
                    r["discarded_before"] = attempt
                    runs.setdefault((method, num_proc), []).append(r)
                    print(
                        f"[{rep + 1}/{args.repeat}] {method:5s} num_proc={num_proc}: {r['seconds']:7.2f} s  "
                        f"{r['pairs'] / r['seconds']:8.0f} pairs/s  cpu {r['cpu_seconds']:.1f} s  "
                        f"other load {r.get('other_load', float('nan')):.2f} cores",
                        file=sys.stderr,
                    )

    summary = {f"{m}@{n}": _summarize(rs) for (m, n), rs in runs.items()}
    ratios = {}
    for n in args.procs:
        ours = summary.get(f"ours@{n}")
        for other in ("trl", "floor"):
            if ours and f"{other}@{n}" in summary:
                ratios[f"ours/{other}@{n}"] = ours["pairs_per_s"] / summary[f"{other}@{n}"]["pairs_per_s"]
        if ours and f"parts@{n}" in summary:
            parts = summary[f"parts@{n}"]
            ratios[f"ours/parts_critical_path@{n}"] = ours["median_seconds"] / parts["median_seconds"]
            ratios[f"merge/ours@{n}"] = parts["phases_median"]["merge"] / ours["median_seconds"]
            ratios[f"all_parts/ours@{n}"] = parts["phases_median"]["all_parts"] / ours["median_seconds"]
        if f"floor@{n}" in summary and f"trl@{n}" in summary:
            ratios[f"floor/trl@{n}"] = summary[f"floor@{n}"]["pairs_per_s"] / summary[f"trl@{n}"]["pairs_per_s"]
    targets = {}
    for n in args.procs:
        if f"ours/trl@{n}" in ratios:
            targets[f"ours>=2x_trl@{n}"] = ratios[f"ours/trl@{n}"] >= 2.0
        if f"ours/floor@{n}" in ratios:
            targets[f"ours>=0.9x_floor@{n}"] = ratios[f"ours/floor@{n}"] >= 0.9
    tokens = {k: v["tokens"] for k, v in summary.items()}

    print()
    print(
        f"{args.pairs} pairs, {os.cpu_count()} CPUs, tokenizer threads {args.tokenizer_threads}, "
        f"median of {args.repeat} (wall time from the JSONL file, "
        "tokenizer load included; cpu s = CPU seconds incl. workers; cores = cpu s / seconds; "
        "other load = cores busy with other jobs)"
    )
    header = (
        f"{'method':6s} {'procs':>5s} {'seconds':>8s} {'min-max':>13s} {'pairs/s':>9s} {'tokens/s':>10s} "
        f"{'cpu s':>6s} {'cores':>5s} {'other load':>10s}"
    )
    print(header)
    print("-" * len(header))
    for n in args.procs:
        for m in args.methods:
            s = summary[f"{m}@{n}"]
            spread = f"{s['min_seconds']:.2f}-{s['max_seconds']:.2f}"
            print(
                f"{m:6s} {n:5d} {s['median_seconds']:8.2f} {spread:>13s} {s['pairs_per_s']:9.0f} "
                f"{s['tokens_per_s']:10.0f} {s['cpu_seconds_median']:6.1f} "
                f"{s['cpu_seconds_median'] / s['median_seconds']:5.2f} {_median_or_nan(s['other_load']):10.2f}"
            )
    print()
    for k, v in ratios.items():
        print(f"{k:16s} {v:5.2f}")
    for k, v in targets.items():
        print(f"target {k:18s} {'met' if v else 'MISSED'}")
    if len(set(tokens.values())) > 1:
        print(f"note: token totals differ between methods: {tokens}")
    prints = {k: rs[0]["fingerprint"] for (m, n), rs in runs.items() if "fingerprint" in rs[0] for k in [f"{m}@{n}"]}
    if len(set(prints.values())) > 1:
        print(f"MISMATCH: the merged parts are not the single build: {prints}")
        return 1
    record = {
        "pairs": args.pairs,
        "seed": args.seed,
        "repeat": args.repeat,
        "cpus": os.cpu_count(),
        "tokenizer_threads": args.tokenizer_threads,
        "procs": args.procs,
        "results": summary,
        "ratios": ratios,
        "targets_met": targets,
        "versions": _versions(),
    }
    line = json.dumps(record, sort_keys=True)
    print("JSON " + line)
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return 0


def _median_or_nan(values: list[float]) -> float:
    return statistics.median(values) if values else float("nan")


def _versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    import dpo_data

    src = Path(dpo_data.__file__).parent
    digest = hashlib.sha256()
    for f in sorted(src.rglob("*.py")):
        digest.update(str(f.relative_to(src)).encode() + b"\0" + f.read_bytes())
    out = {"python": sys.version.split()[0], "dpo_data_path": str(src), "dpo_data_sha256": digest.hexdigest()[:16]}
    try:
        head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True)
        dirty = subprocess.run(
            ["git", "-C", str(src), "status", "--porcelain", "--", "."], capture_output=True, text=True
        )
        if head.returncode == 0:
            out["dpo_data_git"] = head.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")
    except OSError:
        pass
    for pkg in ("dpo-toolkit", "trl", "transformers", "tokenizers", "datasets", "pyarrow"):
        try:
            out[pkg] = version(pkg)
        except PackageNotFoundError:  # recorded as absent in the benchmark's JSON
            out[pkg] = None
    return out


if __name__ == "__main__":
    sys.exit(main())
