"""Training throughput on SmolLM2-135M-Instruct on CPU: dpo-train against TRL 1.16 DPOTrainer, same pairs.

Both train the same pairs in the same order on identical token ids (our loader picks each step's 8 pairs;
TRL gets them as pre-tokenized rows, in that order, with a sequential sampler, batch 4 x accumulation
2), with the same hyperparameters (sigmoid, beta 0.1, AdamW lr 1e-5 constant, clipping 1.0, fp32,
dropout off). Each method runs in a fresh process; the first step (warm-up) is not timed. It also
checks equality: per-pair log-probs of the first micro-batch (TRL's padded forward vs our packed one)
and the step-1 and step-2 losses.

    .venv/bin/python benchmarks/train_throughput.py [--steps 6] [--methods ours-precomputed trl ...]
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
from pathlib import Path

import harness
from trl_peer import HYPER, PAIRS_PER_STEP, train_timed, trl_trainer

from dpo_train.logps.scoring import Scoring

METHODS = ("ours-precomputed", "ours-live", "trl-precomputed", "trl")
MICRO = 4


def _config(model: str, data: str, out: Path, steps: int, reference: dict) -> dict:
    return {
        "model": {"path": model},
        "reference": reference,
        "data": {
            "path": data,
            "batching": "pairs",
            "pairs_per_step": PAIRS_PER_STEP,
            "max_tokens_per_microbatch": 1024,
        },
        "loss": {"type": "sigmoid", "beta": HYPER["beta"]},
        "optim": {"lr": HYPER["lr"], "scheduler": "constant", "max_grad_norm": 1.0},
        "train": {"output_dir": str(out), "max_steps": steps, "precision": "fp32"},
        "distributed": {"device": "cpu"},
    }


def _step_pairs(data: str, steps: int) -> list[list[int]]:
    """The pairs of each step, as dpo-train's loader chooses them."""
    from dpo_data import LoaderConfig
    from dpo_data.loading.loader import DPOLoader

    out: list[list[int]] = [[] for _ in range(steps)]
    for batch in DPOLoader(
        [data], LoaderConfig(batching="pairs", pairs_per_step=PAIRS_PER_STEP, max_tokens_per_microbatch=1024)
    ):
        if batch["step"] >= steps:
            break
        out[batch["step"]] += sorted(batch["pair_index"].tolist())
    return out


def run_ours(model: str, data: str, work: Path, steps: int, precomputed: bool) -> dict:
    from dpo_train.config.loading import load_config
    from dpo_train.precompute import precompute_reference
    from dpo_train.trainer import train

    reference = {"mode": "precomputed", "path": str(work / "sidecar")} if precomputed else {"mode": "live"}
    out = work / f"ours-{precomputed}"
    shutil.rmtree(out, ignore_errors=True)
    config = load_config(_config(model, data, out, steps, reference))
    if precomputed and not (work / "sidecar" / "reference.json").is_file():
        precompute_reference(config)  # once, not timed (TRL's precompute is not timed either)
    train(config, progress=False)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    timed = rows[1:]
    return {
        "pairs_per_s": sum(r["pairs"] for r in timed) / sum(r["pairs"] / r["pairs/s"] for r in timed),
        "losses": [r["loss"] for r in rows],
        "logps_chosen": [r["logps/chosen"] for r in rows],
    }


def run_trl(model: str, data: str, work: Path, steps: int, precomputed: bool) -> dict:
    from dpo_data.dataset.store import PairStore

    store = PairStore([data])
    order = [i for step in _step_pairs(data, steps) for i in step]
    pairs = [store.pair(i) for i in order]
    trainer = trl_trainer(model, pairs, work, MICRO, steps, precomputed)
    ids = trainer.train_dataset
    first = _trl_first_microbatch_logps(trainer, ids)
    stamps, logs = train_timed(trainer)
    timed = stamps[-1] - stamps[0]
    return {
        "pairs_per_s": PAIRS_PER_STEP * (len(stamps) - 1) / timed,
        "losses": [e["loss"] for e in logs],
        "logps_chosen": [e["logps/chosen"] for e in logs],
        "first_microbatch": first,
    }


def _trl_first_microbatch_logps(trainer, ids) -> dict:
    """TRL's per-sequence log-probs of the first micro-batch, computed the way its `_compute_loss` does."""
    import torch

    batch = trainer.data_collator([ids[i] for i in range(MICRO)])
    mask = batch["completion_mask"]
    labels = batch["input_ids"].masked_fill(mask == 0, -100)
    with torch.no_grad():
        out = trainer.model(
            input_ids=batch["input_ids"],
            attention_mask=batch["attention_mask"],
            labels=labels,
            use_cache=False,
            fused_lm_head=True,
        )
    logps = out.log_probs[:, -(mask.shape[1] - 1) :].sum(dim=1)
    chosen, rejected = logps.chunk(2)
    return {"chosen": chosen.tolist(), "rejected": rejected.tolist()}


def ours_first_microbatch_logps(model: str, data: str, steps: int) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from dpo_data.dataset.store import PairStore
    from dpo_data.loading.microbatch import pack_microbatch
    from dpo_train.logps.pairs import pair_logps

    store = PairStore([data])
    first = _step_pairs(data, steps)[0][:MICRO]
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        out = pair_logps(policy, pack_microbatch([store.pair(i) for i in first]), Scoring())
    return {"chosen": out.chosen.tolist(), "rejected": out.rejected.tolist()}


def child(method: str, work: str, steps: int) -> dict:
    """One method's run, in a fresh process."""
    work = Path(work)
    model, data = harness.smollm2_and_sample(work)
    precomputed = method.endswith("precomputed")
    if method.startswith("trl"):
        return run_trl(model, data, work, steps, precomputed)
    result = run_ours(model, data, work, steps, precomputed)
    if method == "ours-live":
        result["first_microbatch"] = ours_first_microbatch_logps(model, data, steps)
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per method (the first is not timed)")
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="dpo-train-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    harness.smollm2_and_sample(work)
    results = {}
    env = {"TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    for method in args.methods:
        results[method] = harness.call(child, method, str(work), args.steps, env=env)
        print(
            f"{method:18s} {results[method]['pairs_per_s']:.3f} pairs/s  losses "
            + " ".join(f"{x:.5f}" for x in results[method]["losses"]),
            flush=True,
        )
    summary = _summary(results)
    for key, value in summary.items():
        print(f"{key}: {value}")
    print("JSON " + json.dumps({"results": results, "summary": summary}))


def _summary(results: dict) -> dict:
    out = {}
    rate = {m: r["pairs_per_s"] for m, r in results.items()}
    for ours, trl in (("ours-precomputed", "trl"), ("ours-live", "trl"), ("ours-precomputed", "trl-precomputed")):
        if ours in rate and trl in rate:
            out[f"{ours} / {trl}"] = round(rate[ours] / rate[trl], 3)
    if "ours-live" in results and "trl" in results:
        a, b = results["ours-live"], results["trl"]
        out["first micro-batch max |logp ours - TRL|"] = max(
            abs(x - y)
            for side in ("chosen", "rejected")
            for x, y in zip(a["first_microbatch"][side], b["first_microbatch"][side])
        )
        out["step-1 |loss ours - TRL|"] = abs(a["losses"][0] - b["losses"][0])
        out["step-2 |loss ours - TRL|"] = abs(a["losses"][1] - b["losses"][1])
        out["step-1 |logps/chosen ours - TRL|"] = abs(a["logps_chosen"][0] - b["logps_chosen"][0])
    return out


if __name__ == "__main__":
    main()
