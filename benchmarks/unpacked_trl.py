"""Training a hybrid model (LFM2) unpacked: `dpo-train` against TRL 1.16 DPOTrainer, same rows, pairs and steps.

The tiny random LFM2 of `unpacked.py` (conv, attention, conv, attention; fp32, CPU), narrowed to hidden 64
(heads of 16, MLP 128) because it takes the vocabulary of the SmolLM2-135M-Instruct tokenizer (49152: at
hidden 256 the LM head made a step 40 s for us and an estimated 85 s for TRL on 2 busy cores), saved once with that
tokenizer beside it, trains for a few optimizer steps on generated conversational pairs (`harness.write_rows`,
built with that tokenizer as `dpo-data build` does) by:

- `ours`: the `dpo-train` command, live reference, `model.attention: auto` (which runs LFM2 unpacked:
  each sequence alone in a right-padded batch; the run must say so on stderr);
- `trl`: TRL 1.16 `DPOTrainer` (`trl_peer.trl_trainer`), live reference, padding as it does, on the same
  token ids in the same order (our loader's pairs of each step, a sequential sampler, 2 micro-batches of 4).

Both: sigmoid, beta 0.1, AdamW lr 1e-5 constant, clipping 1.0, 8 pairs per step, fp32, CPU, no dropout
(LFM2 has none). Each run is a fresh process; the methods alternate (ours, trl, then trl, ours, ...) so
that a busy machine loads both alike. A step's time is the wall time between two step ends (ours: the
`time` of consecutive metrics.jsonl rows; TRL: `on_step_end`), so step 1 (warm-up) is never timed; a
run's rate is the median over its timed steps, a method's the median over its runs. Equality check: the
step-1 loss of both is log 2 (policy = reference); step 2's should agree closely.

    .venv/bin/python benchmarks/unpacked_trl.py [--steps 5] [--repeats 2] [--pairs 64]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import harness
from train_throughput import _config, _step_pairs
from trl_peer import PAIRS_PER_STEP, train_timed, trl_trainer
from unpacked import LAYERS, SIZE

METHODS = ("ours", "trl")
MICRO = 4  # TRL's pairs per micro-batch: 2 micro-batches a step
NARROW = dict(hidden_size=64, intermediate_size=128, head_dim=16)  # over unpacked.SIZE: see the docstring
ENV = {"TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
UNPACKED_NOTE = "packing is off for this model"


def setup(work: Path, pairs: int, seed: int) -> tuple[str, str]:
    """WORK/model (the random LFM2 and the SmolLM2 tokenizer's files) and WORK/train (`pairs` generated rows
    built with that tokenizer), each made once."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from dpo_train.model.bundled import materialize_smollm2

    smollm2 = Path(materialize_smollm2())
    model, data = work / "model", work / "train"
    if not (model / "config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(smollm2)
        ids = {k: getattr(tokenizer, k) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
        shape = {**SIZE, **NARROW, **LAYERS["lfm2"], "vocab_size": len(tokenizer), **ids}
        config = AutoConfig.for_model("lfm2", **shape)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(model)
        for f in smollm2.iterdir():  # the tokenizer's own files, byte for byte: the data's attestation holds
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
                shutil.copy(f, model / f.name)
    if not (data / "manifest.json").is_file():
        harness.write_rows(work / "rows.jsonl", pairs, seed)
        harness.build_dataset([work / "rows.jsonl"], model, data)
    return str(model), str(data)


def run_ours(model: str, data: str, work: Path, steps: int) -> dict:
    """`dpo-train CONFIG --quiet` in its own process; step times from metrics.jsonl."""
    import yaml

    out = work / "ours"
    shutil.rmtree(out, ignore_errors=True)
    config = work / "ours.yaml"
    config.write_text(yaml.safe_dump(_config(model, data, out, steps, {"mode": "live"})))
    argv = [str(Path(sys.executable).with_name("dpo-train")), str(config), "--quiet"]
    proc = subprocess.run(argv, capture_output=True, text=True, env={**os.environ, **ENV})
    if proc.returncode:
        raise harness.ChildFailed(" ".join(argv), proc.returncode, proc.stderr)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "step_seconds": [b["time"] - a["time"] for a, b in zip(rows, rows[1:])],
        "losses": [r["loss"] for r in rows],
        "logps_chosen": [r["logps/chosen"] for r in rows],
        "microbatches": [r["microbatches"] for r in rows],
        "unpacked": UNPACKED_NOTE in proc.stderr,
    }


def run_trl(model: str, data: str, work: str, steps: int) -> dict:
    """TRL's DPOTrainer on our loader's pairs, in order; step times between `on_step_end` calls. Run in a
    fresh interpreter (`harness.call`)."""
    from dpo_data.dataset.store import PairStore

    store = PairStore([data])
    pairs = [store.pair(i) for step in _step_pairs(data, steps) for i in step]
    trainer = trl_trainer(model, pairs, Path(work), MICRO, steps, precomputed=False)
    stamps, logs = train_timed(trainer)
    return {
        "step_seconds": [b - a for a, b in zip(stamps, stamps[1:])],
        "losses": [e["loss"] for e in logs],
        "logps_chosen": [e["logps/chosen"] for e in logs],
        "microbatches": [PAIRS_PER_STEP // MICRO] * len(logs),
        "attention": trainer.model.config._attn_implementation,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--repeats", type=int, default=2, help="runs of each method, alternating")
    parser.add_argument("--pairs", type=int, default=64, help="generated rows in the dataset")
    parser.add_argument("--seed", type=int, default=0, help="seed of the generated rows")
    parser.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()
    if args.steps < 2 or args.steps * PAIRS_PER_STEP > args.pairs:
        parser.error(f"--steps must be 2 or more, and --pairs at least {PAIRS_PER_STEP} per step")
    work = Path(args.work or tempfile.mkdtemp(prefix="dpo-unpacked-trl-"))
    work.mkdir(parents=True, exist_ok=True)
    model, data = setup(work, args.pairs, args.seed)
    runs: dict = {m: [] for m in METHODS}
    for r in range(args.repeats):
        for method in METHODS if r % 2 == 0 else METHODS[::-1]:
            if method == "ours":
                got = run_ours(model, data, work, args.steps)
            else:
                got = harness.call(run_trl, model, data, str(work), args.steps, env=ENV)
            got["pairs_per_s"] = statistics.median(PAIRS_PER_STEP / s for s in got["step_seconds"])
            runs[method].append(got)
            print(
                f"{method:4s} run {r + 1}: {got['pairs_per_s']:.3f} pairs/s (steps "
                + " ".join(f"{s:.2f}" for s in got["step_seconds"])
                + " s)  losses "
                + " ".join(f"{x:.6f}" for x in got["losses"]),
                flush=True,
            )
    summary = _summary(runs)
    for key, value in summary.items():
        print(f"{key}: {value}")
    print("JSON " + json.dumps({"runs": runs, "summary": summary}))


def _summary(runs: dict) -> dict:
    rate = {m: statistics.median(r["pairs_per_s"] for r in v) for m, v in runs.items()}
    first = {m: [r["losses"][0] for r in v] for m, v in runs.items()}
    second = {m: [r["losses"][1] for r in v] for m, v in runs.items()}
    return {
        "pairs/s ours": round(rate["ours"], 3),
        "pairs/s trl": round(rate["trl"], 3),
        "ours / trl": round(rate["ours"] / rate["trl"], 3),
        "ours ran unpacked": all(r["unpacked"] for r in runs["ours"]),
        "micro-batches per step (ours, trl)": (runs["ours"][0]["microbatches"], runs["trl"][0]["microbatches"]),
        "step-1 loss ours": first["ours"],
        "step-1 loss trl": first["trl"],
        "step-1 max |loss - log 2|": max(abs(x - math.log(2)) for v in first.values() for x in v),
        "step-2 |loss ours - trl|": max(abs(a - b) for a in second["ours"] for b in second["trl"]),
    }


if __name__ == "__main__":
    main()
