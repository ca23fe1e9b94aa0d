#!/usr/bin/env python
"""The DPO loader: packing efficiency, throughput against a trainer, restore time, memory.

    python benchmarks/loader_bench.py [--quick] [--pairs 5000] [--repeat 11] [--workdir DIR]

One run builds three datasets with `dpo_data.prepare.build.build` (SmolLM2-135M-Instruct tokenizer) into a
temporary directory:

  sample    every file of examples/sample/ (not heldout/, not README.md): 342 short pairs.
  synth     N conversational pairs (default 5000) from a fixed seed whose word counts are lognormal
            (sigma 1.25), so that pair tokens (both segments, prompt counted twice) spread about 17x
            from the 5th to the 95th percentile and 23x from the 1st to the 99th; the total word count
            of a pair is capped so that every pair fits in the synthetic budget (checked after the build).
  synth4x   4N pairs from the same generator (the first N are `synth`'s), for the memory check.

The token budget of a dataset is the power of two nearest (on a log scale) to 6x its median pair tokens
(the middle of the 4-8x range); a sweep over 4x, 6x and 8x the median (rounded to 64, where every pair
fits) shows how much the result depends on that choice.

1. Packing efficiency, computed by `dpo_data.loading.preview.plan_document` (the loader's own schedule, epoch 0):
   input tokens / (micro-batches holding a pair x budget).
     tokens mode  world 2, 2 micro-batches per rank per step (target >= 97 %)
     pairs mode   world 2, 32 pairs per step (target >= 93 %)
   and each mode's balance: the busiest rank's input tokens over the mean rank's, worst over the steps holding
   at least 4 pairs per rank (target <= 1.05).
     padded       TRL-style padded batching of the same pairs in the same epoch order: fixed batches of
                  B pairs, B = round(mean pairs per micro-batch of pairs mode); each batch is padded to
                  its longest segment: real tokens / (2 x B x longest segment).
   Also reported, two ceilings for pairs mode: with the loader's split of each step's pairs across
   ranks, no packer needs fewer than sum over rank-steps of ceil(rank-step tokens / budget) micro-
   batches; with any split, fewer than sum over steps of ceil(step tokens / budget).
2. Throughput of the loader alone: a full epoch of `synth`, tokens mode, rank 0 of world 2, with
   num_workers 0 and 2 (construction excluded, worker start-up included; median of 3 epochs, 1
   with --quick). Against it, the forward+backward time of a tiny random LlamaForCausalLM (hidden 64,
   intermediate 128, 2 layers, 2 heads, vocab 49152, sdpa) on the micro-batch of median size of that
   epoch (input_ids + position_ids, no attention mask, use_cache=False, loss = mean log-prob of the
   supervised tokens). Ratio = loader micro-batches/s / trainer micro-batches/s (target >= 20x).
3. Restore: time to construct a DPOLoader + load_state_dict + fetch the first micro-batch, from states
   saved after 1 % and after 90 % of rank 0's epoch (tokens mode, num_workers 0); --repeat rounds,
   interleaved, medians. The fetched micro-batch is checked against the uninterrupted epoch. Target:
   90 % / 1 % <= 1.5.
4. Memory: a fresh subprocess imports, builds a DPOLoader on `synth` or `synth4x` (tokens mode, rank 0
   of world 2, num_workers 0) and iterates 200 micro-batches; it reads VmRSS, VmHWM, RssAnon and
   RssFile from /proc/self/status after the imports and after the 200 micro-batches. Reported: both
   RSS values, the 4x/1x ratios of RSS and of anonymous RSS, and the growth over the imports. Target:
   RSS 4x / 1x <= 1.10 (a threshold set here, none was given; the ids stay memory-mapped, so what touched shard
   pages add is file-backed, shared with the page cache and reclaimable).

Output: a table, then one line `JSON {...}` with every measurement.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import shutil
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import harness
import numpy as np

TARGETS = {
    "tokens_eff": 0.97,
    "pairs_eff": 0.93,
    "balance": 1.05,
    "trainer_ratio": 20.0,
    "restore_ratio": 1.5,
    "memory_ratio": 1.10,
}
WORLD, TOKENS_MB_PER_STEP, PAIRS_PER_STEP, SEED = 2, 2, 32, 0
MEMORY_MICROBATCHES = 200
# Synthetic lengths: total words of a pair (prompt + both completions) ~ lognormal(MU, SIGMA), capped.
SYNTH_MU, SYNTH_SIGMA, SYNTH_MIN_WORDS, SYNTH_CAP_WORDS = 5.0, 1.25, 6, 1000
SYNTH_BUDGET = 2048  # every synthetic pair must fit (checked); = the budget rule's value for this data

# -- synthetic data -------------------------------------------------------------------------------

_WORDS = """
the of and to in is that for it as with was on be by this are or from at an have not which but all
they one can more has were their there been if would will when what so about out up into them some
could other time only new these two may then do first any my now such like our over also its after
most made many before must through back years where much your way well down should because each just
those people how too little state good very make world still own see work long get here between both
life being under never day same another know while last might great old year off come since against
system data model value error file process result memory network server client request response
token sequence batch gradient loss learning rate optimizer checkpoint dataset record field column
index table query cache thread worker queue lock buffer stream latency throughput storage cluster
node budget invoice customer order payment account report chapter section summary argument evidence
theory experiment sample measure average median variance estimate probability function variable
river mountain forest valley ocean island city village bridge road garden kitchen window coffee
dinner recipe flour sugar butter salt onion garlic tomato cheese bread history culture language
music painting museum library novel author reader doctor patient treatment hospital weather storm
quickly carefully roughly exactly probably usually rarely clearly simply directly easily important
different possible available similar common specific general simple difficult large small recent
explain describe compare consider suggest include provide require allow ensure improve reduce
""".split()
_NAMES = [
    "Alice",
    "Bob",
    "Chen",
    "Dana",
    "Emeka",
    "Farah",
    "Hiro",
    "Ines",
    "Python",
    "Rust",
    "Linux",
    "Paris",
    "Tokyo",
    "Nairobi",
    "Oslo",
    "Monday",
    "March",
]
_SYSTEMS = [
    "You are a helpful assistant.",
    "Answer in at most three sentences.",
    "You are a careful code reviewer.",
    "Reply in plain English.",
]


def _text(rng: random.Random, n_words: int) -> str:
    out, words = [], 0
    while words < n_words:
        k = min(n_words - words, rng.randrange(4, 16))
        sent = [
            rng.choice(_NAMES)
            if rng.random() < 0.05
            else str(rng.randrange(1, 1000))
            if rng.random() < 0.04
            else rng.choice(_WORDS)
            for _ in range(k)
        ]
        sent[0] = sent[0][:1].upper() + sent[0][1:]
        out.append(" ".join(sent) + rng.choice([".", ".", ".", "?", "!"]))
        words += k
    return " ".join(out)


def synth_rows(n: int, seed: int = SEED):
    """n conversational explicit-prompt pairs (TRL field names); the first n of a larger n are the same."""
    rng = random.Random(seed)
    for i in range(n):
        total = min(SYNTH_CAP_WORDS, int(round(rng.lognormvariate(SYNTH_MU, SYNTH_SIGMA)))) + SYNTH_MIN_WORDS
        n_prompt = max(2, int(total * rng.uniform(0.3, 0.5)))
        n_chosen = max(2, int((total - n_prompt) / 2 * rng.uniform(0.8, 1.2)))
        n_rejected = max(2, total - n_prompt - n_chosen)
        prompt = [{"role": "user", "content": _text(rng, n_prompt)}]
        if rng.random() < 0.3:
            prompt.insert(0, {"role": "system", "content": rng.choice(_SYSTEMS)})
        yield {
            "id": f"synth-{i:06d}",
            "prompt": prompt,
            "chosen": [{"role": "assistant", "content": _text(rng, n_chosen)}],
            "rejected": [{"role": "assistant", "content": _text(rng, n_rejected)}],
        }


def build_dataset(inputs: list[str], tok_dir: Path, out: Path) -> dict:
    t0 = time.perf_counter()
    result = harness.build_dataset(inputs, tok_dir, out, overwrite=True)
    return {"seconds": round(time.perf_counter() - t0, 2), "pairs": result.manifest["totals"]["pairs"]}


# -- helpers --------------------------------------------------------------------------------------


def lengths(ds: Path):
    from dpo_data.dataset.store import PairStore

    store = PairStore([ds])
    idx = np.arange(store.num_pairs)
    return store, store.segment_tokens(idx).astype(np.int64)


def length_stats(pt: np.ndarray) -> dict:
    p = np.percentile(pt, [1, 5, 50, 95, 99])
    return {
        "pairs": int(len(pt)),
        "min": int(pt.min()),
        "p1": float(p[0]),
        "p5": float(p[1]),
        "median": float(p[2]),
        "p95": float(p[3]),
        "p99": float(p[4]),
        "max": int(pt.max()),
        "mean": round(float(pt.mean()), 1),
        "spread_p95_p5": round(float(p[3] / p[1]), 1),
        "spread_p99_p1": round(float(p[4] / p[0]), 1),
    }


def budget_rule(median: float) -> int:
    """The power of two nearest (log scale) to 6x the median pair tokens."""
    return int(2 ** round(math.log2(6 * median)))


def cfg(batching: str, budget: int, num_workers: int = 0, rank: int = 0):
    from dpo_data import LoaderConfig

    return LoaderConfig(
        batching=batching,
        pairs_per_step=PAIRS_PER_STEP,
        max_tokens_per_microbatch=budget,
        microbatches_per_step=TOKENS_MB_PER_STEP,
        world_size=WORLD,
        rank=rank,
        num_workers=num_workers,
        seed=SEED,
    )


def code_version() -> dict:
    """The commit, and the files of the code under test that differ from it (other work in progress)."""

    def git(*a):
        try:
            return subprocess.run(
                ["git", *a], cwd=harness.ROOT, capture_output=True, text=True, check=True
            ).stdout.rstrip()
        except (OSError, subprocess.CalledProcessError):
            return None

    dirty = git("status", "--porcelain", "--", "dpo_data")
    return {"commit": git("rev-parse", "HEAD"), "dpo_data_uncommitted": dirty.splitlines() if dirty else []}


def med(xs):
    return statistics.median(xs)


# -- 1. packing -----------------------------------------------------------------------------------


def packing(ds: Path, budget: int) -> dict:
    from dpo_data.loading.preview import plan_document
    from dpo_data.loading.steps import StepPlanner

    store, pt = lengths(ds)
    seg_c = (store.prompt_len + store.chosen_len).astype(np.int64)
    seg_r = (store.prompt_len + store.rejected_len).astype(np.int64)
    out = {"budget": budget, "budget_over_median": round(budget / float(np.median(pt)), 2)}
    for mode in ("tokens", "pairs"):
        doc = plan_document([ds], cfg(mode, budget))
        t = doc["totals"]
        out[mode] = {
            "efficiency": doc["packing_efficiency"],
            "steps": t["steps"],
            "microbatches": t["microbatches"],
            "empty_microbatches": t["empty_microbatches"],
            "pairs": t["pairs"],
            "pairs_per_microbatch": round(t["pairs"] / t["microbatches"], 3),
            # The busiest rank's tokens over the mean rank's, over steps holding at least 4 pairs per rank.
            "balance_worst": max(
                (
                    s["balance"]
                    for s in doc["steps"]
                    if sum(len(mb["pairs"]) for r in s["ranks"] for mb in r["microbatches"]) >= 4 * WORLD
                ),
                default=1.0,
            ),
            "balance_mean": doc["balance"]["mean"],
        }
        if mode == "pairs":
            # Lower bound on micro-batches once each rank-step's pairs are fixed: ceil(tokens / budget).
            need = sum(
                math.ceil(sum(mb["tokens"] for mb in r["microbatches"]) / budget)
                for s in doc["steps"]
                for r in s["ranks"]
            )
            out[mode]["bound_microbatches"] = need
            out[mode]["bound_efficiency"] = round(t["input_tokens"] / (need * budget), 6)
            # Any split of a step's pairs across ranks: at least ceil(step tokens / budget) micro-batches.
            need_any = sum(
                math.ceil(sum(mb["tokens"] for r in s["ranks"] for mb in r["microbatches"]) / budget)
                for s in doc["steps"]
            )
            out[mode]["step_bound_efficiency"] = round(t["input_tokens"] / (need_any * budget), 6)
            out[mode]["rank_step_tokens_over_budget"] = round(
                t["input_tokens"] / (len(doc["steps"]) * WORLD) / budget, 3
            )
    # Padded batching of the same pairs, in the loader's epoch order, B pairs a batch.
    b = max(1, round(out["pairs"]["pairs_per_microbatch"]))
    order = StepPlanner(pt, store.dataset_sizes, store.fingerprint, cfg("pairs", budget)).order(0)
    real = padded = 0
    for i in range(0, len(order), b):
        chunk = order[i : i + b]
        real += int(pt[chunk].sum())
        padded += 2 * len(chunk) * int(max(seg_c[chunk].max(), seg_r[chunk].max()))
    out["padded"] = {"pairs_per_batch": b, "efficiency": round(real / padded, 6), "batches": math.ceil(len(order) / b)}
    return out


def sweep(ds: Path) -> list[dict]:
    from dpo_data.loading.preview import plan_document

    _, pt = lengths(ds)
    median, rows = float(np.median(pt)), []
    for k in (4, 6, 8):
        budget = int(64 * round(k * median / 64))
        row = {"x_median": k, "budget": budget}
        if budget < pt.max():
            row["skipped"] = f"longest pair {int(pt.max())} > budget"
        else:
            for mode in ("tokens", "pairs"):
                row[mode] = plan_document([ds], cfg(mode, budget))["packing_efficiency"]
        rows.append(row)
    return rows


# -- 2. throughput --------------------------------------------------------------------------------


def loader_epoch(ds: Path, budget: int, num_workers: int) -> dict:
    from dpo_data.loading.loader import DPOLoader

    t0 = time.perf_counter()
    loader = DPOLoader([ds], cfg("tokens", budget, num_workers), max_epochs=1)
    t1 = time.perf_counter()
    n = tokens = 0
    sizes, first = [], None
    for batch in loader:
        n += 1
        if first is None:
            first = time.perf_counter()
        tokens += batch["num_input_tokens"]
        sizes.append(batch["num_input_tokens"])
    t2 = time.perf_counter()
    return {
        "construct_s": t1 - t0,
        "epoch_s": t2 - t1,
        "first_s": first - t1,
        "steady_s": t2 - first,
        "microbatches": n,
        "tokens": tokens,
        "sizes": sizes,
    }


def typical_microbatch(ds: Path, budget: int, size: int) -> dict:
    from dpo_data.loading.loader import DPOLoader

    for batch in DPOLoader([ds], cfg("tokens", budget), max_epochs=1):
        if batch["num_input_tokens"] == size:
            return batch
    raise RuntimeError("the median micro-batch was not found again")


def trainer_step_time(batch: dict, repeat: int) -> dict:
    import torch

    torch.manual_seed(0)
    spec = {"hidden_size": 64, "intermediate_size": 128, "max_position_embeddings": 8192}
    model = harness.tiny_llama_model(**spec, attn_implementation="sdpa")
    model.train()
    ids, pos, labels = batch["input_ids"], batch["position_ids"], batch["labels"]
    mask = labels != -100

    def step():
        logits = model(input_ids=ids, position_ids=pos, use_cache=False).logits
        logp = torch.log_softmax(logits.float(), dim=-1).gather(-1, labels.clamp(min=0)[..., None]).squeeze(-1)
        loss = -(logp * mask).sum() / mask.sum()
        loss.backward()
        model.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    times = [harness.seconds(step) for _ in range(repeat)]
    return {
        "step_s": med(times),
        "step_s_all": [round(t, 4) for t in times],
        "tokens": int(ids.shape[1]),
        "torch_threads": torch.get_num_threads(),
        "params": sum(p.numel() for p in model.parameters()),
    }


def throughput(ds: Path, budget: int, repeat: int, trainer_repeat: int) -> dict:
    out, sizes = {}, None
    for nw in (0, 2):
        runs = [loader_epoch(ds, budget, nw) for _ in range(repeat)]
        sizes = sizes or runs[0]["sizes"]
        epoch = med([r["epoch_s"] for r in runs])
        out[f"workers_{nw}"] = {
            "microbatches": runs[0]["microbatches"],
            "tokens": runs[0]["tokens"],
            "epoch_s": round(epoch, 3),
            "epoch_s_all": [round(r["epoch_s"], 3) for r in runs],
            "construct_s": round(med([r["construct_s"] for r in runs]), 3),
            "microbatches_per_s": round(runs[0]["microbatches"] / epoch, 1),
            "tokens_per_s": round(runs[0]["tokens"] / epoch),
            "first_microbatch_s": round(med([r["first_s"] for r in runs]), 4),
            # after the first micro-batch (workers started): micro-batches 2..n over their time
            "steady_microbatches_per_s": round((runs[0]["microbatches"] - 1) / med([r["steady_s"] for r in runs]), 1),
        }
    size = int(sorted(sizes)[len(sizes) // 2])
    trainer = trainer_step_time(typical_microbatch(ds, budget, size), trainer_repeat)
    trainer["microbatches_per_s"] = round(1.0 / trainer["step_s"], 2)
    out["trainer"] = trainer
    for nw in (0, 2):
        out[f"ratio_workers_{nw}"] = round(
            out[f"workers_{nw}"]["microbatches_per_s"] / trainer["microbatches_per_s"], 1
        )
    return out


# -- 3. restore -----------------------------------------------------------------------------------


def restore(ds: Path, budget: int, repeat: int) -> dict:
    from dpo_data.loading.loader import DPOLoader

    config = cfg("tokens", budget)
    reference = [b["pair_index"].tolist() for b in DPOLoader([ds], config, max_epochs=1)]
    n = len(reference)
    points = {"p01": max(1, round(0.01 * n)), "p90": round(0.90 * n)}
    states = {}
    loader = DPOLoader([ds], config, max_epochs=1)
    for k, _ in enumerate(loader, start=1):
        for name, at in points.items():
            if k == at:
                states[name] = loader.state_dict()
        if len(states) == len(points):
            break

    def once(state):
        t0 = time.perf_counter()
        fresh = DPOLoader([ds], config, max_epochs=1)
        t1 = time.perf_counter()
        fresh.load_state_dict(state)
        t2 = time.perf_counter()
        first = next(iter(fresh))
        t3 = time.perf_counter()
        return first["pair_index"].tolist(), (t3 - t0, t1 - t0, t2 - t1, t3 - t2)

    for name in points:  # warm-up, and the exactness check
        got, _ = once(states[name])
        if got != reference[points[name]]:
            raise SystemExit(
                f"restore at {name} (after {points[name]} micro-batches) fetched pairs {got}; the "
                f"uninterrupted epoch has {reference[points[name]]} there"
            )
    times = {name: [] for name in points}
    for _ in range(repeat):
        for name in points:
            times[name].append(once(states[name])[1])
    out = {"epoch_microbatches": n, "exact": True}
    for name, at in points.items():
        ts = times[name]
        out[name] = {
            "after_microbatches": at,
            "total_s": round(med([t[0] for t in ts]), 4),
            "construct_s": round(med([t[1] for t in ts]), 4),
            "load_state_s": round(med([t[2] for t in ts]), 4),
            "first_fetch_s": round(med([t[3] for t in ts]), 4),
            "total_s_all": [round(t[0], 4) for t in ts],
            "state_json_bytes": len(json.dumps(states[name])),
        }
    out["ratio"] = round(out["p90"]["total_s"] / out["p01"]["total_s"], 3)
    return out


# -- 4. memory ------------------------------------------------------------------------------------


def _status() -> dict:
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(("VmRSS:", "VmHWM:", "RssAnon:", "RssFile:")):
                key, value = line.split(":")
                vals[key] = int(value.split()[0]) * 1024
    return vals


def memory_child(ds: str, budget: int) -> dict:
    """Runs in a fresh process: RSS before the loader, and after 200 micro-batches."""
    import torch  # noqa: F401 - loaded before the "before" RSS, so it is not counted as the loader's
    from torchdata.stateful_dataloader import StatefulDataLoader  # noqa: F401 - likewise

    from dpo_data.loading.loader import DPOLoader

    before = _status()
    loader = DPOLoader([ds], cfg("tokens", budget), max_epochs=None)
    n = 0
    for _ in loader:
        n += 1
        if n == MEMORY_MICROBATCHES:
            break
    after = _status()
    store = loader.stream.store
    per_pair = sum(
        a.nbytes
        for a in (
            store.prompt_len,
            store.chosen_len,
            store.rejected_len,
            store.source_id,
            store._batch_of,
            store._row_of,
            loader.stream.schedule.pair_tokens,
        )
    )
    return {
        "pairs": store.num_pairs,
        "microbatches": n,
        "rss_before": before["VmRSS"],
        "rss_after": after["VmRSS"],
        "anon_before": before["RssAnon"],
        "anon_after": after["RssAnon"],
        "file_before": before["RssFile"],
        "file_after": after["RssFile"],
        "hwm_after": after["VmHWM"],
        "in_memory_bytes_per_pair": round(per_pair / store.num_pairs, 1),
        "dataset_bytes": sum(p.stat().st_size for p in Path(ds).rglob("*") if p.is_file()),
    }


def memory(datasets: dict[str, Path], budget: int, repeat: int) -> dict:
    out = {}
    for name, ds in datasets.items():
        runs = [harness.call(memory_child, str(ds), budget) for _ in range(repeat)]
        r = dict(runs[0])
        for key in ("rss_before", "rss_after", "hwm_after", "anon_before", "anon_after", "file_before", "file_after"):
            r[key] = int(med([x[key] for x in runs]))
        r["growth"] = r["rss_after"] - r["rss_before"]
        r["anon_growth"] = r["anon_after"] - r["anon_before"]
        r["file_growth"] = r["file_after"] - r["file_before"]
        out[name] = r
    a, b = out["synth"], out["synth4x"]
    out["rss_ratio"] = round(b["rss_after"] / a["rss_after"], 3)
    out["hwm_ratio"] = round(b["hwm_after"] / a["hwm_after"], 3)
    out["growth_ratio"] = round(b["growth"] / a["growth"], 3) if a["growth"] > 0 else None
    out["anon_ratio"] = round(b["anon_after"] / a["anon_after"], 3)
    out["anon_growth_ratio"] = round(b["anon_growth"] / a["anon_growth"], 3) if a["anon_growth"] > 0 else None
    return out


# -- report ---------------------------------------------------------------------------------------


def pct(x: float) -> str:
    return f"{100 * x:.1f} %"


def mib(x: int) -> str:
    return f"{x / 2**20:.1f} MiB"


def yes(ok: bool) -> str:
    return "yes" if ok else "NO"


def report(res: dict) -> str:
    rows = [("measurement", "value", "target", "met")]
    for name in ("sample", "synth"):
        p = res["packing"][name]
        tag = f"{name} (budget {p['budget']} = {p['budget_over_median']}x median)"
        rows.append(
            (
                f"{tag}: tokens mode",
                pct(p["tokens"]["efficiency"]),
                ">= 97 %",
                yes(p["tokens"]["efficiency"] >= TARGETS["tokens_eff"]),
            )
        )
        rows.append(
            (
                f"{tag}: pairs mode",
                pct(p["pairs"]["efficiency"]),
                ">= 93 %",
                yes(p["pairs"]["efficiency"] >= TARGETS["pairs_eff"]),
            )
        )
        for mode in ("tokens", "pairs"):
            b = p[mode]
            rows.append(
                (
                    f"{tag}: {mode} mode, balance (busiest rank / mean), worst step; mean",
                    f"{b['balance_worst']:.3f}; {b['balance_mean']:.3f}",
                    "<= 1.05",
                    yes(b["balance_worst"] <= TARGETS["balance"]),
                )
            )
        rows.append((f"{tag}: pairs-mode ceiling, this rank split", pct(p["pairs"]["bound_efficiency"]), "", ""))
        rows.append((f"{tag}: pairs-mode ceiling, any rank split", pct(p["pairs"]["step_bound_efficiency"]), "", ""))
        rows.append(
            (f"{tag}: padded, {p['padded']['pairs_per_batch']} pairs/batch", pct(p["padded"]["efficiency"]), "", "")
        )
    t = res["throughput"]
    for nw in (0, 2):
        w = t[f"workers_{nw}"]
        rows.append(
            (
                f"loader, num_workers {nw}: micro-batches/s (tokens/s), whole epoch",
                f"{w['microbatches_per_s']:.0f} ({w['tokens_per_s'] / 1e6:.2f} M)",
                "",
                "",
            )
        )
        rows.append(
            (
                f"loader, num_workers {nw}: first micro-batch; micro-batches/s after it",
                f"{1000 * w['first_microbatch_s']:.0f} ms; {w['steady_microbatches_per_s']:.0f}",
                "",
                "",
            )
        )
    tr = t["trainer"]
    rows.append(
        (
            f"tiny Llama fwd+bwd, {tr['tokens']}-token micro-batch: micro-batches/s",
            f"{tr['microbatches_per_s']:.2f} ({1000 * tr['step_s']:.0f} ms)",
            "",
            "",
        )
    )
    for nw in (0, 2):
        rows.append(
            (
                f"loader / trainer, num_workers {nw}",
                f"{t[f'ratio_workers_{nw}']:.0f}x",
                ">= 20x",
                yes(t[f"ratio_workers_{nw}"] >= TARGETS["trainer_ratio"]),
            )
        )
    r = res["restore"]
    rows.append(("restore at 1 % (construct + load + first fetch)", f"{1000 * r['p01']['total_s']:.1f} ms", "", ""))
    rows.append(("restore at 90 %", f"{1000 * r['p90']['total_s']:.1f} ms", "", ""))
    rows.append(("restore 90 % / 1 %", f"{r['ratio']:.2f}", "<= 1.5", yes(r["ratio"] <= TARGETS["restore_ratio"])))
    m = res["memory"]
    for name in ("synth", "synth4x"):
        x = m[name]
        rows.append(
            (
                f"RSS after {MEMORY_MICROBATCHES} micro-batches, {name} ({x['pairs']} pairs)",
                f"{mib(x['rss_after'])} (+{mib(x['growth'])} over imports)",
                "",
                "",
            )
        )
        rows.append(
            (
                "  of which anonymous / file-backed (growth over imports)",
                f"{mib(x['anon_after'])} (+{mib(x['anon_growth'])}) / {mib(x['file_after'])} "
                f"(+{mib(x['file_growth'])})",
                "",
                "",
            )
        )
    rows.append(("RSS 4x / 1x", f"{m['rss_ratio']:.3f}", "<= 1.10", yes(m["rss_ratio"] <= TARGETS["memory_ratio"])))
    rows.append(("anonymous RSS 4x / 1x", f"{m['anon_ratio']:.3f}", "", ""))
    rows.append(
        (
            "loader growth over imports 4x / 1x (all; anonymous)",
            f"{m['growth_ratio']}; {m['anon_growth_ratio']}",
            "",
            "",
        )
    )
    widths = [max(len(str(row[i])) for row in rows) for i in range(4)]
    lines = [" | ".join(str(c).ljust(w) for c, w in zip(row, widths)) for row in rows]
    lines.insert(1, "-+-".join("-" * w for w in widths))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="1000 synthetic pairs, fewer repeats (a smoke run)")
    ap.add_argument("--pairs", type=int, default=None, help="synthetic pairs (default 5000, --quick 1000)")
    ap.add_argument("--repeat", type=int, default=None, help="restore rounds (default 11, --quick 3)")
    ap.add_argument("--workdir", default=None, help="keep the datasets here (default: a temporary directory)")
    ap.add_argument(
        "--pairs-per-step", type=int, default=32, help="pairs mode: pairs per step (default 32)", dest="pairs_per_step"
    )
    args = ap.parse_args()
    globals()["PAIRS_PER_STEP"] = args.pairs_per_step
    n = args.pairs or (1000 if args.quick else 5000)
    repeat = args.repeat or (3 if args.quick else 11)
    epoch_repeat, trainer_repeat, mem_repeat = (1, 3, 1) if args.quick else (3, 10, 3)

    from dpo_train.model.bundled import materialize_smollm2

    tok = materialize_smollm2()
    work = Path(args.workdir) if args.workdir else Path(tempfile.mkdtemp(prefix="loader_bench_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        res: dict = {
            "date": datetime.date.today().isoformat(),
            "machine": {"cpus": os.cpu_count(), "python": platform.python_version(), "platform": platform.platform()},
            "code": code_version(),
            "quick": args.quick,
            "config": {
                "world_size": WORLD,
                "tokens_microbatches_per_step": TOKENS_MB_PER_STEP,
                "pairs_per_step": PAIRS_PER_STEP,
                "seed": SEED,
            },
        }
        rows = list(synth_rows(4 * n))
        harness.write_jsonl(work / "synth.jsonl", rows[:n])
        harness.write_jsonl(work / "synth4x.jsonl", rows)
        del rows
        ds = {"sample": work / "sample", "synth": work / "synth", "synth4x": work / "synth4x"}
        res["build"] = {
            "sample": build_dataset(harness.sample_inputs(), tok, ds["sample"]),
            "synth": build_dataset([str(work / "synth.jsonl")], tok, ds["synth"]),
            "synth4x": build_dataset([str(work / "synth4x.jsonl")], tok, ds["synth4x"]),
        }
        res["lengths"] = {name: length_stats(lengths(d)[1]) for name, d in ds.items()}
        budgets = {name: budget_rule(res["lengths"][name]["median"]) for name in ("sample", "synth")}
        for name in ("synth", "synth4x"):
            if res["lengths"][name]["max"] > budgets["synth"]:
                raise SystemExit(
                    f"{name}: a pair has {res['lengths'][name]['max']} tokens, over the budget "
                    f"{budgets['synth']}; lower SYNTH_CAP_WORDS"
                )
        print(f"built in {work}: " + json.dumps(res["build"]), flush=True)
        res["packing"] = {name: packing(ds[name], budgets[name]) for name in ("sample", "synth")}
        res["sweep"] = {name: sweep(ds[name]) for name in ("sample", "synth")}
        print("packing done", flush=True)
        res["throughput"] = throughput(ds["synth"], budgets["synth"], epoch_repeat, trainer_repeat)
        print("throughput done", flush=True)
        res["restore"] = restore(ds["synth"], budgets["synth"], repeat)
        print("restore done", flush=True)
        res["memory"] = memory({"synth": ds["synth"], "synth4x": ds["synth4x"]}, budgets["synth"], mem_repeat)
        p, t, r, m = res["packing"], res["throughput"], res["restore"], res["memory"]
        res["targets_met"] = {
            "tokens_eff_sample": p["sample"]["tokens"]["efficiency"] >= TARGETS["tokens_eff"],
            "tokens_eff_synth": p["synth"]["tokens"]["efficiency"] >= TARGETS["tokens_eff"],
            "pairs_eff_sample": p["sample"]["pairs"]["efficiency"] >= TARGETS["pairs_eff"],
            "pairs_eff_synth": p["synth"]["pairs"]["efficiency"] >= TARGETS["pairs_eff"],
            **{
                f"balance_{mode}_{name}": p[name][mode]["balance_worst"] <= TARGETS["balance"]
                for name in ("sample", "synth")
                for mode in ("tokens", "pairs")
            },
            "trainer_ratio_workers_0": t["ratio_workers_0"] >= TARGETS["trainer_ratio"],
            "trainer_ratio_workers_2": t["ratio_workers_2"] >= TARGETS["trainer_ratio"],
            "restore_ratio": r["ratio"] <= TARGETS["restore_ratio"],
            "memory_ratio": m["rss_ratio"] <= TARGETS["memory_ratio"],
        }
        print()
        print(
            "lengths (pair tokens): "
            + "; ".join(
                f"{k}: median {v['median']:.0f}, p5 {v['p5']:.0f}, p95 {v['p95']:.0f} "
                f"({v['spread_p95_p5']}x), max {v['max']}"
                for k, v in res["lengths"].items()
            )
        )
        print("budget sweep: " + json.dumps(res["sweep"]))
        print(report(res))
        for w in ("workers_0", "workers_2"):
            t[w].pop("sizes", None)
        print("JSON " + json.dumps(res))
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
