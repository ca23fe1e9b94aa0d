"""Peak memory per rank and pairs/s, world 2 FSDP2 with a live reference, on SmolLM2-135M-Instruct (CPU):
the reference replicated (as before it was sharded) against sharded, and LoRA against full fine-tuning.

Each variant is one `dpo-train` run under torchrun (2 ranks, gloo) on the bundled sample, 4 steps of 8
pairs, fp32, AdamW. Memory is each rank process's lifetime peak RSS (`ru_maxrss`) and its highest RSS
while training (sampled every 20 ms after the first step), both from `benchmarks/rank_peak.py`; pairs/s
is the median over the steps after the first (warm-up). glibc's malloc is told to map every allocation
over 64 KiB on its own (MALLOC_MMAP_THRESHOLD_), so a freed tensor leaves RSS at once: by default its
threshold grows with the tensors freed, and RSS then keeps memory no tensor uses. The
replicated variant patches the trainer so that the frozen reference is a whole copy on every rank, which
is what every rank held before; nothing else differs.

    .venv/bin/python benchmarks/memory_bench.py [--steps 4] [--variants full-replicated full-sharded lora]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import harness
import yaml

VARIANTS = {
    "full-replicated": {"patch": "replicated-reference"},
    "full-sharded": {},
    "lora": {"lora": {"r": 8, "alpha": 16, "target_modules": "all-linear"}},
}


def run(variant: str, model: str, data: str, work: Path, steps: int) -> dict:
    spec = VARIANTS[variant]
    out = work / variant
    config = {
        "model": {"path": model, **({"lora": spec["lora"]} if "lora" in spec else {})},
        "reference": {"mode": "live"},
        "data": {"path": data, "batching": "pairs", "pairs_per_step": 8, "max_tokens_per_microbatch": 1024},
        "optim": {"lr": 1.0e-5},
        "train": {"output_dir": str(out), "max_steps": steps, "precision": "fp32"},
        "distributed": {"strategy": "fsdp", "device": "cpu"},
    }
    path = work / f"{variant}.yaml"
    path.write_text(yaml.safe_dump(config))
    peaks = work / f"{variant}-peaks"
    env = {**os.environ, "RANK_PEAK_OUT": str(peaks), "RANK_PEAK_PATCH": spec.get("patch", "")}
    env["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # RSS follows the live tensors (see above)
    args = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    args += [str(harness.HERE / "rank_peak.py"), str(path), "--quiet"]
    subprocess.run(args, check=True, env=env, cwd=harness.ROOT, stdout=subprocess.DEVNULL)
    ranks = [json.loads(p.read_text()) for p in sorted(peaks.glob("rank-*.json"))]
    records = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "variant": variant,
        "peak_rss_mib_per_rank": [r["peak_rss_mib"] for r in ranks],
        "training_rss_mib_per_rank": [r["training_rss_mib"] for r in ranks],
        "pairs_per_s": statistics.median(r["pairs/s"] for r in records[1:]),
        "final_loss": records[-1]["loss"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model, data = harness.smollm2_and_sample(work)
        results = [run(v, model, data, work, args.steps) for v in args.variants]
    base = {r["variant"]: r for r in results}
    for r in results:
        line = (
            f"{r['variant']:16} peak RSS per rank {r['peak_rss_mib_per_rank']} MiB, while training "
            f"{r['training_rss_mib_per_rank']} MiB, {r['pairs_per_s']:.2f} pairs/s"
        )
        if "full-sharded" in base and r["variant"] != "full-sharded":
            ref = base["full-sharded"]
            ratio = max(r["training_rss_mib_per_rank"]) / max(ref["training_rss_mib_per_rank"])
            speed = r["pairs_per_s"] / ref["pairs_per_s"]
            line += f"; vs full-sharded: training memory x{ratio:.3f}, speed x{speed:.2f}"
        print(line)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
