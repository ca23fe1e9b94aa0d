"""What the trust checks cost: shard verification before training, and the micro-batch contract check.

- Shard verification (`dpo_data.dataset.verify.shard_problems`, what `dpo-train` runs before its first
  step with `data.verify: full` or `size`): seconds and GB/s on a synthetic 20k-pair dataset (about 30 MB
  of shards) with 1, 2 and 4 hashing threads, page cache warm; and on the demo's dataset (the bundled
  sample) as a fraction of the demo's first optimizer step.
- The micro-batch contract check (`dpo_data.contract_problems`, run by `dpo-train` on every micro-batch):
  its time over the demo's micro-batches against the demo's step time.
- The first step's gradient-norm check (`dpo_train.step.grad_norm.gradient_norm`, once per process): its
  time over the demo model's gradients against torch's `clip_grad_norm_` and the demo's first step.
- The export's read-back (`dpo_train.export.reload.reload_difference`, `train.read_back`, once per export): the demo
  model written as `dpo-train` writes final/ (bf16, its config's dtype: `export_state` and the files), then
  loaded back and compared, against the write.
- The installed-release check (`dpo_state.installed.check_installed`, once per `dpo-train` / `dpo-data build`)
  and the source fingerprint every rank of a multi-process run computes (`code_fingerprint`): their times
  against the demo's first step.

The demo's step: SmolLM2-135M-Instruct, 8 pairs per step, 1024-token micro-batches, live reference, CPU,
one process; the first step is timed (it includes warm-up), then --steps more.

    .venv/bin/python benchmarks/trust_overhead.py [--pairs 20000] [--steps 2]
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import harness


def _build(inputs: list[str], tokenizer_dir: str, out: Path) -> Path:
    harness.build_dataset(inputs, tokenizer_dir, out, num_proc=2)
    return out


def _shard_bytes(dataset: Path) -> int:
    return sum(p.stat().st_size for p in (dataset / "shards").iterdir())


def verification(dataset: Path) -> dict:
    from dpo_data.dataset.verify import shard_problems

    size = _shard_bytes(dataset)
    shard_problems([dataset], "full", threads=4)  # warm the page cache: every run below reads from memory
    out = {"bytes": size}
    for threads in (1, 2, 4):
        seconds = harness.median_seconds(lambda t=threads: shard_problems([dataset], "full", threads=t))
        out[f"full_{threads}_threads"] = {"seconds": round(seconds, 4), "GB/s": round(size / seconds / 1e9, 3)}
    out["size_only_seconds"] = round(harness.median_seconds(lambda: shard_problems([dataset], "size")), 5)
    return out


def demo_step(dataset: Path, model_dir: str, steps: int) -> dict:
    """The demo's optimizer steps, in process; micro-batches kept to time the contract check on them."""
    from dpo_data import DPOLoader, contract_problems
    from dpo_train.config.loading import load_config

    config = load_config(
        {
            "model": {"path": model_dir},
            "data": {"path": str(dataset), "pairs_per_step": 8, "max_tokens_per_microbatch": 1024},
            "loss": {"type": "sigmoid", "beta": 0.1},
            "optim": {"lr": 2.0e-5},
            "distributed": {"device": "cpu"},
        }
    )
    loader = DPOLoader(config.data.paths, config.data.loader_config(0, 1), pad_to_multiple_of=8)
    trainer = harness.cpu_trainer(config, loader.stream.store)
    step_seconds, batches = harness.timed_steps(trainer, loader, steps)
    check = harness.median_seconds(lambda: [contract_problems(b) for b in batches], repeat=20)
    per_step = check / (len(step_seconds))
    return {
        "first_step_s": round(step_seconds[0], 3),
        "step_s": round(statistics.median(step_seconds[1:]), 3),
        "microbatches": len(batches),
        "contract_check_s_per_step": round(per_step, 6),
        "contract_check_fraction_of_step": round(per_step / statistics.median(step_seconds[1:]), 6),
        **_norm_check(trainer, batches[0], step_seconds[0]),
    }


def _norm_check(trainer, batch: dict, first_step_s: float) -> dict:
    """The gradient-norm check on real gradients (one micro-batch's), against clip_grad_norm_ on the same
    (max_norm inf: nothing clipped), and the installed-release check; both as fractions of the first step."""
    import torch

    from dpo_state.installed import check_installed, code_fingerprint
    from dpo_train.step.grad_norm import gradient_norm

    trainer.microbatch(batch)
    parameters = [p for p in trainer.policy.parameters() if p.grad is not None]
    ours = harness.median_seconds(lambda: gradient_norm(parameters), repeat=10)
    theirs = harness.median_seconds(lambda: torch.nn.utils.clip_grad_norm_(parameters, float("inf")), repeat=10)
    trainer.optimizer.zero_grad(set_to_none=True)
    releases = harness.median_seconds(check_installed, repeat=10)
    source = harness.median_seconds(code_fingerprint, repeat=10)
    return {
        "grad_norm_check_s": round(ours, 5),
        "clip_grad_norm_s": round(theirs, 5),
        "grad_norm_check_fraction_of_first_step": round(ours / first_step_s, 6),
        "installed_check_s": round(releases, 5),
        "installed_check_fraction_of_first_step": round(releases / first_step_s, 6),
        "code_fingerprint_s": round(source, 5),
    }


def export_reload(model_dir: str, work: Path) -> dict:
    """The demo model's export written (as final/ is: its config's dtype) and read back, each timed."""
    import torch
    from transformers import AutoModelForCausalLM

    from dpo_train.export.final import export_state, write_weights
    from dpo_train.export.reload import reload_difference

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    times: dict[str, list[float]] = {"write": [], "read-back": []}
    for i in range(3):
        staging = work / f"export-{i}"
        started = time.perf_counter()
        written = export_state(model, model.state_dict(), torch.bfloat16)
        write_weights(model, staging, written, torch.bfloat16)
        times["write"].append(time.perf_counter() - started)
        started = time.perf_counter()
        found = reload_difference(model, staging, written, torch.bfloat16)
        times["read-back"].append(time.perf_counter() - started)
        assert not found, found
        shutil.rmtree(staging)
    write, back = statistics.median(times["write"]), statistics.median(times["read-back"])
    return {
        "export_write_s": round(write, 3),
        "export_read_back_s": round(back, 3),
        "read_back / write": round(back / write, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=20000)
    parser.add_argument("--steps", type=int, default=2)
    args = parser.parse_args()
    from dpo_train.model.bundled import materialize_smollm2

    model_dir = str(materialize_smollm2())
    work = Path(tempfile.mkdtemp(prefix="dpo-trust-bench-"))
    try:
        demo = _build(harness.sample_inputs(), model_dir, work / "demo")
        harness.write_rows(work / "synth.jsonl", args.pairs, seed=1234)
        synth = _build([str(work / "synth.jsonl")], model_dir, work / "synth")
        result = {
            "synthetic": verification(synth),
            "demo_dataset": verification(demo),
            "demo_step": demo_step(demo, model_dir, args.steps),
            "export": export_reload(model_dir, work),
        }
        full_demo = result["demo_dataset"]["full_4_threads"]["seconds"]
        result["verify_full_fraction_of_first_step"] = round(full_demo / result["demo_step"]["first_step_s"], 6)
        for key, value in result.items():
            print(f"{key}: {value}")
        print("JSON " + json.dumps(result))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
