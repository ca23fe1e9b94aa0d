"""`dpo-data plan`: preview which pairs form each step and micro-batch on each rank, and how full they are."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from dpo_data.dataset.store import PairStore
from dpo_data.loading.config import LoaderConfig
from dpo_data.loading.steps import PlannerState, StepPlanner
from dpo_state.schema import validate

PLAN_FORMAT_VERSION = 2


def plan_document(
    dirs: list[str | Path], config: LoaderConfig, epoch: int = 0, steps: int | None = None
) -> dict[str, Any]:
    """Run the loader's own schedule for `steps` steps of `epoch` (all of it when None).

    `pairs` are global pair indices: row positions in the dataset, or in the mixture's order (the
    datasets' rows one after the other, in the order given). `tokens` are a micro-batch's input tokens.
    Packing efficiency = input tokens / (micro-batches holding a pair x max_tokens_per_microbatch). A step's
    balance is its busiest rank's input tokens over the mean rank's (1.0: every rank the same work).
    """
    store = PairStore(dirs)
    tokens = store.segment_tokens(np.arange(store.num_pairs), config.layout)
    schedule = StepPlanner(tokens, store.dataset_sizes, store.fingerprint, replace(config, rank=0))
    state, out = PlannerState(epoch=epoch), []
    while steps is None or len(out) < steps:
        plan, state = schedule.next_step(state)
        if plan is None:
            break
        loads = [int(sum(tokens[mb].sum() for mb in mbs if mb)) for mbs in plan.ranks]
        out.append(
            {
                "step": plan.step,
                "epoch": plan.epoch,
                "balance": _balance(loads),
                "ranks": [
                    {
                        "rank": r,
                        "microbatches": [{"pairs": mb, "tokens": int(tokens[mb].sum()) if mb else 0} for mb in mbs],
                    }
                    for r, mbs in enumerate(plan.ranks)
                ],
            }
        )
    used = [mb["tokens"] for s in out for r in s["ranks"] for mb in r["microbatches"] if mb["pairs"]]
    capacity = len(used) * config.max_tokens_per_microbatch
    document = {
        "format_version": PLAN_FORMAT_VERSION,
        "datasets": [str(d) for d in dirs],
        "fingerprint": store.fingerprint,
        "config": config.geometry(store.fingerprint),
        "steps": out,
        "totals": {
            "steps": len(out),
            "pairs": sum(len(mb["pairs"]) for s in out for r in s["ranks"] for mb in r["microbatches"]),
            "microbatches": len(used),
            "empty_microbatches": sum(
                1 for s in out for r in s["ranks"] for mb in r["microbatches"] if not mb["pairs"]
            ),
            "input_tokens": int(sum(used)),
            "capacity_tokens": capacity,
        },
        "packing_efficiency": round(sum(used) / capacity, 6) if capacity else 0.0,
        "balance": {
            "worst": max((s["balance"] for s in out), default=1.0),
            "mean": round(float(np.mean([s["balance"] for s in out])), 6) if out else 1.0,
        },
    }
    validate("plan", document, "the plan document")  # the format --json promises
    return document


def _balance(loads: list[int]) -> float:
    """The busiest rank's tokens over the mean rank's: every rank waits for the busiest one at the step's end."""
    mean = sum(loads) / len(loads)
    return round(max(loads) / mean, 6) if mean else 1.0


def format_plan(doc: dict[str, Any], show_steps: int = 3) -> str:
    """Readable summary: totals, the first steps, and a histogram of micro-batch fill."""
    t, c = doc["totals"], doc["config"]
    lines = [
        f"{c['batching']} batching, world size {c['world_size']}, budget {c['max_tokens_per_microbatch']} tokens"
        f" per micro-batch, seed {c['seed']}",
        f"{t['steps']} steps, {t['pairs']} pairs, {t['microbatches']} micro-batches "
        f"(+{t['empty_microbatches']} empty), {t['input_tokens']} input tokens",
        f"packing efficiency {doc['packing_efficiency']:.1%} (input tokens / capacity of used micro-batches)",
        f"balance: busiest rank's tokens / mean rank's, worst step {doc['balance']['worst']:.3f}, "
        f"mean {doc['balance']['mean']:.3f}",
    ]
    for s in doc["steps"][:show_steps]:
        lines.append(f"step {s['step']} (epoch {s['epoch']}), balance {s['balance']:.3f}")
        for r in s["ranks"]:
            mbs = ", ".join(f"{len(mb['pairs'])} pairs/{mb['tokens']} tok" for mb in r["microbatches"])
            lines.append(f"  rank {r['rank']}: {mbs}")
    fills = [
        mb["tokens"] / c["max_tokens_per_microbatch"]
        for s in doc["steps"]
        for r in s["ranks"]
        for mb in r["microbatches"]
        if mb["pairs"]
    ]
    if fills:
        counts, edges = np.histogram(fills, bins=10, range=(0.0, 1.0))
        lines.append("micro-batch fill")
        width = max(counts.max(), 1)
        for n, lo in zip(counts, edges):
            lines.append(f"  {lo:4.0%}-{lo + 0.1:4.0%} {n:6d} {'#' * int(40 * n / width)}")
    return "\n".join(lines)
