"""What a loss type costs per optimizer step, against sigmoid in the same run: AOT's pass without gradient.

The demo's step (SmolLM2-135M-Instruct, 8 pairs per step, micro-batches of at most 512 tokens so that a step
holds several, live reference, CPU, one process), each objective in a fresh process, the objectives
interleaved over `--rounds` so that drift of a shared machine falls on all of them; the first step (warm-up)
is not counted.

    .venv/bin/python benchmarks/loss_cost.py [--steps 3] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
from pathlib import Path

import harness

OBJECTIVES = {
    "sigmoid": {"type": "sigmoid"},
    "aot": {"type": ["aot", "aot_unpaired"]},
    "mpo": {"type": ["sigmoid", "bco_pair", "sft"], "weights": [0.8, 0.2, 1.0]},
}


def step_seconds(dataset: str, model_dir: str, loss: dict, steps: int) -> dict:
    """Wall seconds of each optimizer step after the first, and the step's micro-batches."""
    from dpo_data import DPOLoader
    from dpo_train.config.loading import load_config

    config = load_config(
        {
            "model": {"path": model_dir},
            "data": {"path": dataset, "pairs_per_step": 8, "max_tokens_per_microbatch": 512},
            "loss": loss,
            "optim": {"lr": 2.0e-5},
            "distributed": {"device": "cpu"},
        }
    )
    loader = DPOLoader(config.data.paths, config.data.loader_config(0, 1), pad_to_multiple_of=8)
    trainer = harness.cpu_trainer(config, loader.stream.store)
    times, batches = harness.timed_steps(trainer, loader, steps)
    microbatches = [b["microbatches_in_step"] for b in batches if b["microbatch"] == 0]
    return {"step_s": times[1:], "microbatches": microbatches[1:]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="dpo-loss-bench-"))
    try:
        model_dir, dataset = harness.smollm2_and_sample(work)
        seen = {name: {"step_s": [], "microbatches": []} for name in OBJECTIVES}
        for _ in range(args.rounds):
            for name, loss in OBJECTIVES.items():
                got = harness.call(step_seconds, dataset, model_dir, loss, args.steps)
                for key in seen[name]:
                    seen[name][key] += got[key]
        base = statistics.median(seen["sigmoid"]["step_s"])
        result = {
            name: {
                "median_step_s": round(statistics.median(s["step_s"]), 3),
                "ratio_to_sigmoid": round(statistics.median(s["step_s"]) / base, 3),
                "microbatches_per_step": statistics.median(s["microbatches"]),
            }
            for name, s in seen.items()
        }
        for name, value in result.items():
            print(f"{name}: {value}")
        print("JSON " + json.dumps(result))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
