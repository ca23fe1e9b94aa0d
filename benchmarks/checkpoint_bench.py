"""Checkpoint save and load against plain torch.save / torch.load of the same tensors; inspect and diff time.

A random Llama (hidden 384, 4 layers, the SmolLM2 vocabulary of 49152: 45M parameters) trained one step
with AdamW gives a checkpoint of about 540 MB (weights and two moments in fp32). Timed, each the median of
--repeat runs:
- save: `dpo_train.checkpoint.save.save` (DCP with 2 writer threads and fsync, rank files, state.json,
  sha256 of every file, commit record) against `torch.save({"model", "optim"})` of the same state
  dicts to one file, and against the same torch.save followed by fsync (a durable save);
- read-back: what `train.read_back` adds to a process's first save (`read_back` on the checkpoint just
  saved: every tensor loaded again and compared bit for bit, the rank files read back), against the save;
- load: `restore` (hash verification of every file, identity check, DCP load, loader and RNG state)
  against `torch.load(weights_only=True)` plus `load_state_dict` into the same modules;
- `dpo-state inspect` and `dpo-state diff` (without --values) as commands, wall time including start-up.

    .venv/bin/python benchmarks/checkpoint_bench.py [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import harness

MODEL = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 384,
    "intermediate_size": 1024,
    "num_hidden_layers": 4,
    "num_attention_heads": 6,
    "num_key_value_heads": 6,
}


def _trainer(data: str, out: Path):
    from dpo_data.loading.loader import DPOLoader
    from dpo_data.loading.microbatch import is_last
    from dpo_train.config.loading import load_config

    config = load_config(
        {
            "model": {"init": {"config": MODEL, "seed": 0}},
            "reference": {"mode": "none"},
            "loss": {"type": "simpo"},
            "data": {"path": data, "pairs_per_step": 4},
            "train": {"output_dir": str(out), "save_every": 1, "keep_last": 100},
            "distributed": {"device": "cpu"},
        }
    )
    loader = DPOLoader([data], config.data.loader_config(0, 1), pad_to_multiple_of=8)
    trainer = harness.cpu_trainer(config, loader.stream.store, out=out)
    it = iter(loader)
    while True:  # one optimizer step, so the optimizer has its moments
        batch = next(it)
        trainer.microbatch(batch)
        if is_last(batch):
            break
    trainer.step()
    return trainer, loader


def _save_fsync(torch, state, path: Path) -> None:
    """torch.save made durable the way a checkpoint must be: the bytes on disk before returning."""
    with open(path, "wb") as f:
        torch.save(state, f)
        f.flush()
        os.fsync(f.fileno())


def _read_back(parts, run, directory: Path) -> None:
    from dpo_train.checkpoint.read_back import read_back

    assert read_back(parts, run, directory) == "", "a checkpoint just saved must read back"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    import torch

    from dpo_state.layout import step_dir
    from dpo_train.checkpoint.parts import new_lineage
    from dpo_train.checkpoint.restore import restore
    from dpo_train.checkpoint.save import save

    work = Path(tempfile.mkdtemp(prefix="dpo-ckpt-bench-"))
    try:
        data = harness.smollm2_and_sample(work)[1]
        trainer, loader = _trainer(data, work / "run")
        parts, identity = trainer.checkpointable(loader), trainer.identity()
        model_sd, optim_sd = trainer.policy.state_dict(), trainer.optimizer.state_dict()
        times: dict[str, list[float]] = {
            k: []
            for k in (
                "save",
                "read-back",
                "torch.save",
                "torch.save+fsync",
                "load",
                "torch.load",
                "inspect",
                "diff",
            )
        }
        for i in range(args.repeat):
            plain = work / f"plain-{i}.pt"
            times["torch.save"].append(
                harness.seconds(lambda: torch.save({"model": model_sd, "optim": optim_sd}, plain))
            )
            plain_bytes = plain.stat().st_size
            durable = work / f"durable-{i}.pt"
            times["torch.save+fsync"].append(
                harness.seconds(lambda: _save_fsync(torch, {"model": model_sd, "optim": optim_sd}, durable))
            )
            durable.unlink()
            trainer.state.step = i + 1
            times["save"].append(harness.seconds(lambda: save(parts, trainer.run, identity, new_lineage())))
            times["read-back"].append(
                harness.seconds(lambda: _read_back(parts, trainer.run, step_dir(work / "run", i + 1)))
            )

            def plain_load():
                state = torch.load(plain, weights_only=True)
                trainer.policy.load_state_dict(state["model"])
                trainer.optimizer.load_state_dict(state["optim"])

            times["torch.load"].append(harness.seconds(plain_load))
            times["load"].append(
                harness.seconds(lambda: restore(parts, trainer.run, identity, step_dir(work / "run", i + 1)))
            )
            cli = [sys.executable, "-m", "dpo_cli.state"]
            a, b = step_dir(work / "run", i + 1), step_dir(work / "run", max(1, i))
            times["inspect"].append(
                harness.seconds(lambda: subprocess.run([*cli, "inspect", str(a)], check=True, capture_output=True))
            )
            times["diff"].append(
                harness.seconds(lambda: subprocess.run([*cli, "diff", str(a), str(b)], capture_output=True))
            )
            plain.unlink()
        size = sum(p.stat().st_size for p in step_dir(work / "run", 1).rglob("*") if p.is_file())
        med = {k: statistics.median(v) for k, v in times.items()}
        summary = {
            "checkpoint_bytes": size,
            "torch_save_bytes": plain_bytes,
            **{f"{k}_s": round(v, 3) for k, v in med.items()},
            "save / torch.save": round(med["save"] / med["torch.save"], 2),
            "save / (torch.save + fsync)": round(med["save"] / med["torch.save+fsync"], 2),
            "read-back / save": round(med["read-back"] / med["save"], 2),
            "load / torch.load": round(med["load"] / med["torch.load"], 2),
        }
        for key, value in summary.items():
            print(f"{key}: {value}")
        print("JSON " + json.dumps(summary))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
