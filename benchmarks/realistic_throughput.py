"""Training throughput on a realistic preference profile: dpo-train (separate and shared-prompt layouts)
against TRL 1.16 DPOTrainer, SmolLM2-135M-Instruct on CPU, with model FLOPs utilization.

A conversational preference set is generated from a seed with the length profile of public sets such as
UltraFeedback (tokens with the SmolLM2 chat template: prompt median ~150, p95 ~600, 30 % multi-turn;
completions median ~250, p95 ~800, chosen and rejected drawn independently), built with
`dpo_data.prepare.build.build`, and trained on by every method on the same pairs in the same order
(our loader picks each step's pairs; TRL gets them as pre-tokenized rows with a sequential sampler),
same hyperparameters (sigmoid, beta 0.1, AdamW lr 1e-5 constant, clipping 1.0, fp32, dropout off).
Each method runs in a fresh process; the first step is not timed. The same run measures this machine's
fp32 matmul rate (square matmuls, all cores, best of several) and reports model FLOPs utilization
against it, useful (the same FLOPs for every trainer, from the pairs' real lengths in the separate
layout) and hardware (what each trainer computed: padding, the shared prompt, attention per segment for ours,
over the whole padded row for TRL).

    .venv/bin/python benchmarks/realistic_throughput.py [--steps 1] [--warmup 0] [--pairs 400] [--repeats 1]
        [--methods ours-separate-live ours-shared-live trl-b8-live trl-b1-live ...] [--work DIR] [--json PATH]

trl-b8 is TRL's default batch (8 pairs per micro-batch, one micro-batch per step), trl-b1 1 pair per micro-batch x 8
accumulation steps; both with TRL's default gradient_checkpointing (on), which recomputes the policy's forward in
its backward. trl-b1-...-nogc turns it off: TRL's fastest valid setting on CPU, as ours runs without activation
checkpointing here (padding_free is disabled in TRL 1.16 and needs FlashAttention). Each method's result is also
saved under WORK/results; `--summarize --work DIR` rebuilds the tables from them (after an interrupted run, or to
add a method run alone with `--child METHOD`). A step takes 5-10 minutes per method on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import harness
from trl_peer import HYPER, PAIRS_PER_STEP, trl_trainer

from dpo_train.logps.scoring import Scoring

CAP = 4096  # the generator keeps every pair's separate row (2 prompts + both completions) within this
MEMORY_LIMIT = 17 << 30  # address space of each child: a trainer that needs more fails cleanly instead of
# pushing a shared machine into the OOM killer
# (median, p95) in tokens as the chat template renders them
PROMPT_PROFILE, COMPLETION_PROFILE, MULTI_TURN = (150, 600), (250, 800), 0.30
METHODS = (
    "ours-separate-live",
    "ours-shared-live",
    "ours-separate-precomputed",
    "ours-shared-precomputed",
    "trl-b8-live",
    "trl-b1-live",
    "trl-b8-precomputed",
    "trl-b1-precomputed",
    "trl-b1-live-nogc",
    "trl-b1-precomputed-nogc",
)
"""trl-...-nogc: TRL with gradient_checkpointing off (its DPOConfig turns it on by default; ours runs without
activation checkpointing here, so TRL's fastest valid setting is without it too)."""
DEFAULT_METHODS = (
    "ours-separate-live",
    "ours-shared-live",
    "trl-b8-live",
    "trl-b1-live-nogc",
    "ours-shared-precomputed",
    "trl-b1-precomputed-nogc",
)
WORDS = (
    "the of and to in is that it for on with as was be by this are or from at an have not but what all were when "
    "we there can which their if will each about how up out them then she many some so these would other into has "
    "more her two like him see time could no make than first been its who now people my made over did down only "
    "way find use may water long little very after words called just where most know get through back much before "
    "go good new write our used me man too any day same right look think also around another came come work three "
    "word must because does part even place well such here take why things help put years different away again "
    "off went old number great tell men say small every found still between name should home big give air line "
    "set own under read last never us left end along while might next sound below saw something thought both few "
    "those always looked show large often together asked house world going want school important until form food "
    "keep children feet land side without once life enough took sometimes four head above kind began almost live "
    "page got earth need far hand high year light parts country let night following picture being study second "
    "soon times story since white days ever paper hard near sentence better best across during today others "
    "however sure means model data train function value return error result list code test input output memory "
    "system query answer question"
).split()


# ---------------------------------------------------------------- data


def _lognormal(rng: random.Random, profile: tuple[int, int]) -> int:
    median, p95 = profile
    return max(1, round(median * math.exp(rng.gauss(0.0, math.log(p95 / median) / 1.6449))))


def generate_rows(n: int, seed: int, tokenizer) -> tuple[list[dict], int]:
    """n conversational explicit-prompt rows; lengths are drawn in tokens and realised by decoding windows of a
    tokenized random-word text. A draw whose separate row (2 prompts + both completions) would not fit the
    micro-batch budget is redrawn; the number redrawn is returned."""
    rng = random.Random(seed)
    text = []
    for _ in range(60_000):
        word, r = rng.choice(WORDS), rng.random()
        word = word + "," if r < 0.06 else word + "." if r < 0.10 else word
        word = str(rng.randint(0, 9999)) if 0.10 <= r < 0.11 else f"`{word}()`" if 0.11 <= r < 0.12 else word
        text.append(word)
    pool = tokenizer(" ".join(text), add_special_tokens=False)["input_ids"]

    def content(k: int) -> str:
        start = rng.randrange(0, len(pool) - k - 1)
        return tokenizer.decode(pool[start : start + k]).strip() or "ok"

    rows, redrawn = [], 0
    while len(rows) < n:
        prompt, chosen, rejected = (_lognormal(rng, p) for p in (PROMPT_PROFILE,) + (COMPLETION_PROFILE,) * 2)
        if 2 * prompt + chosen + rejected > CAP - 64:
            redrawn += 1
            continue
        exchanges = rng.choice((1, 2)) if rng.random() < MULTI_TURN else 0
        body = max(4 * (2 * exchanges + 1), prompt - 30 - 8 * exchanges)  # template: ~30 + ~8 per exchange
        cuts = sorted(rng.sample(range(1, body), 2 * exchanges)) if exchanges else []
        parts = [b - a for a, b in zip([0] + cuts, cuts + [body])]
        messages = [
            {"role": "user" if i % 2 == 0 else "assistant", "content": content(max(2, k))} for i, k in enumerate(parts)
        ]
        rows.append(
            {
                "id": len(rows),
                "prompt": messages,
                "chosen": [{"role": "assistant", "content": content(max(2, chosen - 2))}],
                "rejected": [{"role": "assistant", "content": content(max(2, rejected - 2))}],
            }
        )
    return rows, redrawn


def _build(rows: list[dict], model: str, out: Path) -> dict:
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.parent / (out.name + ".jsonl")
    harness.write_jsonl(src, rows)
    result = harness.build_dataset([src], model, out, overwrite=True)
    return {"rows": result.rows_read, "kept": result.pairs, "rejects": result.rejects_by_reason}


def prepare(work: Path, pairs: int, steps: int, seed: int, pairs_per_step: int = PAIRS_PER_STEP) -> dict:
    """Materialize the model, generate, build the full set (for the profile) and the training subset (the first
    steps x pairs_per_step rows: one epoch of it is exactly the timed run, so a precompute pass scores only
    trained pairs)."""
    from transformers import AutoTokenizer

    from dpo_train.model.bundled import materialize_smollm2

    model = str(materialize_smollm2())
    meta = work / "meta.json"
    want = {"pairs": pairs, "steps": steps, "seed": seed}
    if pairs_per_step != PAIRS_PER_STEP:  # only then: a work directory of this script's default stays valid
        want["pairs_per_step"] = pairs_per_step
    if meta.is_file() and json.loads(meta.read_text()).get("want") == want:
        return json.loads(meta.read_text())
    rows, redrawn = generate_rows(max(pairs, steps * pairs_per_step), seed, AutoTokenizer.from_pretrained(model))
    full = _build(rows, model, work / "full")
    train = _build(rows[: steps * pairs_per_step], model, work / "train")
    from dpo_data.dataset.store import PairStore

    store = PairStore([str(work / "train")])
    longest = max(2 * len(p.prompt) + len(p.chosen) + len(p.rejected) for p in map(store.pair, range(store.num_pairs)))
    info = {
        "want": want,
        # max_tokens_per_microbatch: the smallest multiple of 512 that holds the longest trained pair whole
        "budget": max(1024, -(-longest // 512) * 512),
        "longest_pair": longest,
        "model": model,
        "data": str(work / "train"),
        "redrawn": redrawn,
        "build_full": full,
        "build_train": train,
        "profile_full": _profile(str(work / "full")),
        "profile_train": _profile(str(work / "train")),
        "padding_full": padding_profile(str(work / "full")),
    }
    meta.write_text(json.dumps(info))
    return info


def _profile(data: str) -> dict:
    from dpo_data.dataset.store import PairStore

    store = PairStore([data])
    p, c, r, turns = [], [], [], 0
    for i in range(store.num_pairs):
        pair = store.pair(i)
        p.append(len(pair.prompt))
        c.append(len(pair.chosen))
        r.append(len(pair.rejected))
    multi = 0
    src = Path(data).parent / (Path(data).name + ".jsonl")
    for line in src.read_text().splitlines():
        turns += 1
        multi += len(json.loads(line)["prompt"]) > 1

    def q(xs: list[int]) -> dict:
        s = sorted(xs)
        return {"median": s[len(s) // 2], "p95": s[min(len(s) - 1, int(0.95 * len(s)))], "max": s[-1]}

    comps = c + r
    return {
        "pairs": len(p),
        "prompt": q(p),
        "completion": q(comps),
        "multi_turn": multi / max(turns, 1),
        "chosen_ne_rejected": sum(a != b for a, b in zip(c, r)) / len(c),
        "separate_tokens_per_pair": sum(2 * a + b + d for a, b, d in zip(p, c, r)) / len(p),
        "shared_tokens_per_pair": sum(a + b + d for a, b, d in zip(p, c, r)) / len(p),
    }


# ---------------------------------------------------------------- FLOPs


def model_shape(model: str) -> dict:
    cfg = json.loads((Path(model) / "config.json").read_text())
    d, layers, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["intermediate_size"]
    heads, kv = cfg["num_attention_heads"], cfg.get("num_key_value_heads", cfg["num_attention_heads"])
    head_dim = cfg.get("head_dim") or d // heads
    per_layer = d * heads * head_dim + 2 * d * kv * head_dim + heads * head_dim * d + 3 * d * inter
    return {
        "hidden": d,
        "layers": layers,
        "vocab": cfg["vocab_size"],
        "attn_width": heads * head_dim,
        "matmul_params": per_layer * layers,
    }


def forward_flops(shape: dict, tokens: int, supervised: int, score_pairs: int) -> float:
    """One forward: 2 x (decoder matmul weights) per token, the LM head (2 d V) at the positions that are
    scored only (both trainers project only there), and attention: 2 x width per (query, key) pair for the
    scores and 2 x width for the weighted values, per layer."""
    return (
        2 * shape["matmul_params"] * tokens
        + 2 * shape["hidden"] * shape["vocab"] * supervised
        + 4 * shape["attn_width"] * score_pairs * shape["layers"]
    )


def useful_work(data: str, order: list[int], shape: dict) -> dict:
    """Per pair, from the real lengths in the separate layout: [prompt + chosen][prompt + rejected], causal."""
    from dpo_data.dataset.store import PairStore

    store = PairStore([data])
    tokens = supervised = pairs_qk = 0
    for i in order:
        pair = store.pair(i)
        for completion in (pair.chosen, pair.rejected):
            s = len(pair.prompt) + len(completion)
            tokens, supervised, pairs_qk = tokens + s, supervised + len(completion), pairs_qk + s * (s + 1) // 2
    return {"tokens": tokens, "supervised": supervised, "score_pairs": pairs_qk}


def padding_profile(data: str) -> dict:
    """Tokens fed per pair over the whole generated set (in row order): ours separate (both segments), ours
    shared prompt (the prompt once), and TRL's collator (prompt + completion per row, right-padded to the
    longest row of the micro-batch, 2 rows per pair) at 8 and 1 pairs per micro-batch."""
    from dpo_data.dataset.store import PairStore

    store = PairStore([data])
    pairs = [store.pair(i) for i in range(store.num_pairs)]
    n = len(pairs)
    out = {
        "pairs": n,
        "separate": sum(2 * len(p.prompt) + len(p.chosen) + len(p.rejected) for p in pairs) / n,
        "shared_prompt": sum(len(p.prompt) + len(p.chosen) + len(p.rejected) for p in pairs) / n,
    }
    for b in (8, 4, 1):
        padded = 0
        for start in range(0, n - n % b, b):
            group = pairs[start : start + b]
            padded += 2 * b * max(len(p.prompt) + max(len(p.chosen), len(p.rejected)) for p in group)
        out[f"trl_b{b}"] = padded / (n - n % b)
    return out


def ours_geometry(data: str, layout: str, steps: int, budget: int, pairs_per_step: int = PAIRS_PER_STEP) -> list[dict]:
    """Each micro-batch our loader hands the trainer: row length (no padding) and segment lengths."""
    from dpo_data import LoaderConfig
    from dpo_data.loading.loader import DPOLoader

    out = []
    config = LoaderConfig(
        batching="pairs", pairs_per_step=pairs_per_step, max_tokens_per_microbatch=budget, layout=layout
    )
    for batch in DPOLoader([data], config):
        if batch["step"] >= steps or batch["epoch"] > 0:
            break
        out.append(
            {
                "step": int(batch["step"]),
                "pairs": batch["pair_index"].tolist(),
                "row": int(batch["input_ids"].shape[1]),
                "segments": batch["segment_length"].tolist(),
                "context": batch["segment_context"].tolist() if "segment_context" in batch else None,
            }
        )
    return out


def hardware_from_rows(rows: list[tuple[int, int]], supervised: int, score_pairs: int | None = None) -> dict:
    """rows: (row length, rows of that length). sdpa on CPU with a mask (TRL: the padding mask; ours under
    `model.attention: sdpa`: the packed or shared-prompt row mask) scores every (query, key) pair of the
    row: T^2, unless `score_pairs` says otherwise (ours' segment attention, `segment_score_pairs`)."""
    return {
        "tokens": sum(t * n for t, n in rows),
        "supervised": supervised,
        "score_pairs": sum(t * t * n for t, n in rows) if score_pairs is None else score_pairs,
    }


def segment_score_pairs(micro: dict) -> int:
    """The (query, key) pairs ours' segment attention scores in one row (dpo_train/segment_attention.py):
    causal within a segment without a mask, s (s + 1) / 2 (the CPU kernel skips blocks above the diagonal);
    a shared-prompt completion of c tokens under its mask scores all its keys, c (prompt + c)."""
    lengths, context = micro["segments"], micro["context"] or [-1] * len(micro["segments"])
    return sum(s * (s + 1) // 2 if c < 0 else s * (lengths[c] + s) for s, c in zip(lengths, context))


# ---------------------------------------------------------------- the trainers (child processes)


@dataclass(frozen=True)
class Setting:
    """How a trainer runs, besides the data: this script's CPU fp32 by default; benchmarks/gpu_throughput.py
    varies it. `attention` and `train` are ours' (model.attention, more train-section keys as (key, value)
    pairs); `device`, `precision` (TRL: bf16 autocast when "bf16") and `pairs_per_step` are both sides'."""

    device: str = "cpu"
    precision: str = "fp32"
    attention: str = "auto"
    pairs_per_step: int = PAIRS_PER_STEP
    train: tuple = ()


def _config(info: dict, out: Path, steps: int, reference: dict, layout: str, setting: Setting = Setting()) -> dict:
    return {
        "model": {"path": info["model"], "attention": setting.attention},
        "reference": reference,
        "data": {
            "path": info["data"],
            "batching": "pairs",
            "pairs_per_step": setting.pairs_per_step,
            "max_tokens_per_microbatch": info["budget"],
            "layout": layout,
        },
        "loss": {"type": "sigmoid", "beta": HYPER["beta"]},
        "optim": {"lr": HYPER["lr"], "scheduler": "constant", "max_grad_norm": 1.0},
        "train": {"output_dir": str(out), "max_steps": steps, "precision": setting.precision, **dict(setting.train)},
        "distributed": {"device": setting.device},
    }


def run_ours(
    info: dict, work: Path, steps: int, warmup: int, layout: str, precomputed: bool, setting: Setting = Setting()
) -> dict:
    from dpo_train.config.loading import load_config
    from dpo_train.precompute import precompute_reference
    from dpo_train.trainer import train

    sidecar = work / f"sidecar-{layout}"
    reference = {"mode": "precomputed", "path": str(sidecar)} if precomputed else {"mode": "live"}
    out = work / f"ours-{layout}-{precomputed}"
    shutil.rmtree(out, ignore_errors=True)
    config = load_config(_config(info, out, steps, reference, layout, setting))
    if precomputed:
        shutil.rmtree(sidecar, ignore_errors=True)
        precompute_reference(config)  # not timed (TRL's precompute is not timed either)
        if setting.device == "cuda":  # the training's peak, not the precompute pass's
            import torch

            torch.cuda.reset_peak_memory_stats()
    train(config, progress=False)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    timed = rows[warmup:]
    seconds = sum(r["pairs"] / r["pairs/s"] for r in timed)
    return {
        "step_seconds": [r["pairs"] / r["pairs/s"] for r in rows],
        "pairs_per_s": sum(r["pairs"] for r in timed) / seconds,
        "timed_seconds": seconds,
        "timed_pairs": sum(r["pairs"] for r in timed),
        "input_tokens_timed": sum(r["input_tokens"] for r in timed),
        "losses": [r["loss"] for r in rows],
        "peak_rss_mib": harness.peak_rss_mib(),
    }


def run_trl(
    info: dict,
    work: Path,
    steps: int,
    warmup: int,
    micro: int,
    precomputed: bool,
    setting: Setting = Setting(),
    speed: dict | None = None,
) -> dict:
    """TRL on the pairs of ours' steps, in ours' order within each step; `speed`: `trl_trainer`'s (with the
    setting's bf16). On CUDA each clock reading waits for the device."""
    import torch
    from transformers import TrainerCallback

    from dpo_data.dataset.store import PairStore

    store = PairStore([info["data"]])
    pps = setting.pairs_per_step
    geometry = ours_geometry(info["data"], "separate", steps, info["budget"], pps)
    order = [i for s in range(steps) for i in sorted(p for g in geometry if g["step"] == s for p in g["pairs"])]
    pairs = [store.pair(i) for i in order]
    speed = {"bf16": setting.precision == "bf16", **(speed or {})}
    trainer = trl_trainer(info["model"], pairs, work, micro, steps, precomputed, pps, setting.device, speed)
    ids = trainer.train_dataset
    padded = []  # what TRL's collator feeds the model: (row length, rows) per micro-batch
    for start in range(0, len(pairs), micro):
        batch = trainer.data_collator([ids[i] for i in range(start, start + micro)])
        padded.append([int(batch["input_ids"].shape[1]), int(batch["input_ids"].shape[0])])
    begins: list[float] = []
    ends: list[float] = []
    sync = torch.cuda.synchronize if setting.device == "cuda" else lambda: None

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            sync()
            begins.append(time.perf_counter())

        def on_step_end(self, *a, **k):
            sync()
            ends.append(time.perf_counter())

    trainer.add_callback(Clock())
    trainer.train()
    logs = [e for e in trainer.state.log_history if "loss" in e and "train_runtime" not in e]
    # each optimizer step from its first micro-batch to the end of its optimizer step, as ours measures a step
    durations = [b - a for a, b in zip(begins, ends)]
    timed = sum(durations[warmup:])
    return {
        "pairs_per_s": pps * len(durations[warmup:]) / timed,
        "step_seconds": durations,
        "timed_seconds": timed,
        "timed_pairs": pps * len(durations[warmup:]),
        "padding_free": bool(getattr(trainer, "padding_free", False)),  # what TRL kept (1.16 turns it off)
        "padded": padded,
        "losses": [e["loss"] for e in logs],
        "peak_rss_mib": harness.peak_rss_mib(),
    }


def run_profile(info: dict, work: Path, steps: int, layout: str) -> dict:
    """Where ours spends a micro-batch (live reference): the first micro-batch of step 0 once to warm up,
    then again with each phase timed (reference forward, policy forward, policy backward, clipping and the
    AdamW step) under torch.profiler for the top operators. The phases are what the trainer runs
    (`pair_logps` on the same packed row); the trainer's own bookkeeping is not included."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    from dpo_data import LoaderConfig
    from dpo_data.loading.loader import DPOLoader
    from dpo_train.attention.choice import attention_for
    from dpo_train.logps.pairs import pair_logps
    from dpo_train.parallel.device import placement

    attention = attention_for("auto", placement("cpu", "fp32"), layout=layout)  # what dpo-train picks

    def load():
        m = AutoModelForCausalLM.from_pretrained(info["model"], dtype=torch.float32, attn_implementation=attention)
        m.config.use_cache = False
        return m

    policy, reference = load().train(), load().eval()
    for p in reference.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(policy.parameters(), lr=HYPER["lr"])
    config = LoaderConfig(
        batching="pairs", pairs_per_step=PAIRS_PER_STEP, max_tokens_per_microbatch=info["budget"], layout=layout
    )
    batch = next(iter(DPOLoader([info["data"]], config)))
    phases: dict[str, float] = {}

    def clock(name, fn):
        t = time.perf_counter()
        out = fn()
        phases[name] = time.perf_counter() - t
        return out

    def one():
        with torch.no_grad():
            ref = clock("reference forward", lambda: pair_logps(reference, batch, Scoring()))
        pol = clock("policy forward", lambda: pair_logps(policy, batch, Scoring()))
        logits = HYPER["beta"] * ((pol.chosen - ref.chosen) - (pol.rejected - ref.rejected))
        loss = -torch.nn.functional.logsigmoid(logits).sum() / PAIRS_PER_STEP
        clock("policy backward", lambda: loss.backward())
        clock("clip + AdamW step", lambda: (torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0), opt.step()))
        clock("zero_grad", lambda: opt.zero_grad(set_to_none=True))

    one()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        one()
    events = prof.key_averages()
    total = sum(e.self_cpu_time_total for e in events)
    top = sorted(events, key=lambda e: -e.self_cpu_time_total)[:12]
    return {
        "layout": layout,
        "row": int(batch["input_ids"].shape[1]),
        "pairs": len(batch["pair_index"]),
        "segments": batch["segment_length"].tolist(),
        "phases_s": phases,
        "top_ops": [
            {
                "op": e.key,
                "self_s": e.self_cpu_time_total / 1e6,
                "share": e.self_cpu_time_total / total,
                "calls": e.count,
            }
            for e in top
        ],
        "peak_rss_mib": harness.peak_rss_mib(),
    }


def matmul_peak(sizes=(2048, 3072, 4096), repeats: int = 5, dtype: str = "float32", device: str = "cpu") -> dict:
    """The best FLOP/s of square matmuls of `dtype` on `device` (CUDA: each timing waits for the device)."""
    import torch

    sync = torch.cuda.synchronize if device == "cuda" else lambda: None
    best = {}
    for n in sizes:
        a, b = (torch.randn(n, n, dtype=getattr(torch, dtype), device=device) for _ in range(2))
        torch.mm(a, b)
        sync()

        def mm(a=a, b=b):
            torch.mm(a, b)
            sync()

        best[n] = 2 * n**3 / min(harness.seconds(mm) for _ in range(repeats))
    return {
        "threads": torch.get_num_threads(),
        "dtype": dtype,
        "device": device,
        "by_size_gflops": {k: v / 1e9 for k, v in best.items()},
        "peak": max(best.values()),
    }


def child(method: str, work: Path, steps: int, warmup: int, info: dict) -> dict:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    if method == "matmul":
        return matmul_peak()
    if method.startswith("profile-"):
        return run_profile(info, work, steps, method.split("-", 1)[1])
    method, nogc = method.removesuffix("-nogc"), method.endswith("-nogc")
    precomputed = method.endswith("precomputed")
    if method.startswith("trl"):
        speed = {"gradient_checkpointing": False} if nogc else None  # TRL's DPOConfig turns it on by default
        return run_trl(info, work, steps, warmup, int(method.split("-")[1][1:]), precomputed, speed=speed)
    layout = "shared_prompt" if "-shared-" in method else "separate"
    return run_ours(info, work, steps, warmup, layout, precomputed)


# ---------------------------------------------------------------- parent


def _spawn(method: str, args, work: Path) -> dict:
    """One method in a fresh process (this script's --child); a failure is recorded, not fatal."""
    env = {"TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}
    argv = [__file__, "--child", method, "--steps", args.steps, "--pairs", args.pairs]
    argv += ["--seed", args.seed, "--work", work, "--warmup", args.warmup]
    started = time.perf_counter()
    try:
        result = harness.run_child(argv, env, label=method)
    except harness.ChildFailed as failed:
        reason = ([x for x in failed.stderr.splitlines() if x.strip()] or ["?"])[-1][:300]
        print(f"{method} failed (rc {failed.returncode}): {reason}", flush=True)
        return {"failed": failed.returncode, "reason": reason, "wall_s": time.perf_counter() - started}
    result["wall_s"] = time.perf_counter() - started
    return result


def _median_result(results: list[dict]) -> dict:
    ok = [r for r in results if "failed" not in r]
    if not ok:
        return results[0]
    ok.sort(key=lambda r: r["pairs_per_s"])
    out = dict(ok[len(ok) // 2])
    out["pairs_per_s_all"] = [r["pairs_per_s"] for r in results if "failed" not in r]
    return out


def summarize(info: dict, results: dict, peak: float, steps: int, warmup: int) -> dict:
    shape = model_shape(info["model"])
    sep = ours_geometry(info["data"], "separate", steps, info["budget"])
    shared = ours_geometry(info["data"], "shared_prompt", steps, info["budget"])
    timed_order = [p for g in sep if g["step"] >= warmup for p in g["pairs"]]
    n = len(timed_order)
    useful = useful_work(info["data"], timed_order, shape)
    table = {}
    for method, r in results.items():
        if "failed" in r:
            table[method] = {"failed": r["failed"], "reason": r.get("reason")}
            continue
        live = method.removesuffix("-nogc").endswith("-live")
        passes = 4 if live else 3  # policy forward + backward (3 forwards' worth), + reference forward when live
        # hardware only: TRL's default gradient_checkpointing recomputes the policy's forward in its backward
        recompute = 1 if method.startswith("trl") and not method.endswith("-nogc") else 0
        score_pairs = None
        if method.startswith("ours"):
            geo = [g for g in (shared if "-shared-" in method else sep) if g["step"] >= warmup]
            rows = [(g["row"], 1) for g in geo]
            score_pairs = sum(segment_score_pairs(g) for g in geo)
        else:
            micro = int(method.split("-")[1][1:])
            per_step = PAIRS_PER_STEP // micro
            rows = [tuple(x) for x in r["padded"][per_step * warmup :]]  # micro-batches of the timed steps
        hardware = hardware_from_rows(rows, useful["supervised"], score_pairs)
        useful_fwd = forward_flops(shape, useful["tokens"], useful["supervised"], useful["score_pairs"])
        hard_fwd = forward_flops(shape, hardware["tokens"], hardware["supervised"], hardware["score_pairs"])
        seconds = n / r["pairs_per_s"]
        table[method] = {
            "pairs_per_s": r["pairs_per_s"],
            "pairs_per_s_all": r.get("pairs_per_s_all", [r["pairs_per_s"]]),
            "tokens_per_pair": hardware["tokens"] / n,
            "useful_tokens_per_pair": useful["tokens"] / n,
            "peak_rss_mib": r["peak_rss_mib"],
            "useful_tflop_per_pair": passes * useful_fwd / n / 1e12,
            "hardware_tflop_per_pair": (passes + recompute) * hard_fwd / n / 1e12,
            "useful_gflops": passes * useful_fwd / seconds / 1e9,
            "hardware_gflops": (passes + recompute) * hard_fwd / seconds / 1e9,
            "mfu_useful": passes * useful_fwd / seconds / peak,
            "mfu_hardware": (passes + recompute) * hard_fwd / seconds / peak,
            "losses": r["losses"],
        }
        if method.startswith("ours"):
            table[method]["input_tokens_per_pair_metrics"] = r["input_tokens_timed"] / r["timed_pairs"]
    ratios = {}
    t = {m: v for m, v in table.items() if "failed" not in v}

    def ratio(a, b, key="pairs_per_s"):
        if a in t and b in t:
            ratios[f"{a} / {b} ({key})"] = round(t[a][key] / t[b][key], 3)

    for ref in ("live", "precomputed"):
        for ours in ("separate", "shared"):
            for trl in ("b8", "b1", "b1-nogc"):
                ratio(f"ours-{ours}-{ref}", f"trl-{trl.split('-')[0]}-{ref}{trl[2:]}")
        ratio(f"ours-shared-{ref}", f"ours-separate-{ref}")
        ratio(f"ours-shared-{ref}", f"ours-separate-{ref}", "tokens_per_pair")
        for trl in ("b8", "b1"):
            ratio(f"ours-shared-{ref}", f"trl-{trl}-{ref}", "tokens_per_pair")
            ratio(f"ours-separate-{ref}", f"trl-{trl}-{ref}", "tokens_per_pair")
    ratio("ours-shared-precomputed", "trl-b8-live")
    # same first loss on identical pairs (a check that the comparison trains the same thing)
    first = {m: v["losses"][0] for m, v in t.items()}
    return {
        "model_shape": shape,
        "timed_pairs": n,
        "useful_per_pair": {k: v / n for k, v in useful.items()},
        "microbatches_per_step": {
            "separate": [sum(1 for g in sep if g["step"] == s) for s in range(steps)],
            "shared_prompt": [sum(1 for g in shared if g["step"] == s) for s in range(steps)],
        },
        "table": table,
        "ratios": ratios,
        "step1_loss": first,
    }


def _print(info: dict, peak_info: dict, summary: dict, profile: dict | None) -> None:
    print(
        f"\ngenerated {info['build_full']['rows']} rows, kept {info['build_full']['kept']}, rejected "
        f"{info['build_full']['rejects']}; redrawn over budget: {info['redrawn']}"
    )
    for name in ("profile_full", "profile_train"):
        p = info[name]
        print(
            f"{name}: pairs {p['pairs']}, prompt median/p95/max {p['prompt']['median']}/{p['prompt']['p95']}/"
            f"{p['prompt']['max']}, completion {p['completion']['median']}/{p['completion']['p95']}/"
            f"{p['completion']['max']}, multi-turn {p['multi_turn']:.0%}, chosen != rejected length "
            f"{p['chosen_ne_rejected']:.0%}, tokens/pair separate {p['separate_tokens_per_pair']:.0f}, shared "
            f"{p['shared_tokens_per_pair']:.0f} ({p['shared_tokens_per_pair'] / p['separate_tokens_per_pair']:.3f})"
        )
    pad = info["padding_full"]
    print(
        f"tokens fed per pair over all {pad['pairs']} pairs: separate {pad['separate']:.0f}, shared prompt "
        f"{pad['shared_prompt']:.0f} (x{pad['shared_prompt'] / pad['separate']:.3f}), TRL padded b8 "
        f"{pad['trl_b8']:.0f}, b4 {pad['trl_b4']:.0f}, b1 {pad['trl_b1']:.0f}; shared / TRL b8 "
        f"x{pad['shared_prompt'] / pad['trl_b8']:.3f}, shared / TRL b1 x{pad['shared_prompt'] / pad['trl_b1']:.3f}"
    )
    print(
        f"budget (max_tokens_per_microbatch): {info['budget']} (longest trained pair, separate: {info['longest_pair']})"
    )
    print(f"matmul fp32 peak: {peak_info['peak'] / 1e9:.1f} GFLOP/s ({peak_info})")
    print(f"micro-batches per step: {summary['microbatches_per_step']}")
    hdr = "| method | pairs/s | tokens computed/pair | peak RSS MiB | useful TFLOP/pair | hardware TFLOP/pair | "
    print("\n" + hdr + "useful GFLOP/s | MFU useful | MFU hardware | step-1 loss |")
    print("|---" * 10 + "|")
    for m, v in summary["table"].items():
        if "failed" in v:
            print(f"| {m} | failed (rc {v['failed']}): {v.get('reason')} |")
            continue
        print(
            f"| {m} | {v['pairs_per_s']:.4f} | {v['tokens_per_pair']:.0f} | {v['peak_rss_mib']:.0f} | "
            f"{v['useful_tflop_per_pair']:.3f} | {v['hardware_tflop_per_pair']:.3f} | {v['useful_gflops']:.1f} | "
            f"{v['mfu_useful']:.1%} | {v['mfu_hardware']:.1%} | {v['losses'][0]:.5f} |"
        )
    print()
    for k, v in summary["ratios"].items():
        print(f"{k}: {v}")
    if profile and "failed" not in profile:
        total = sum(profile["phases_s"].values())
        where = f"{profile['layout']}, live, one micro-batch, row {profile['row']}, {profile['pairs']} pairs"
        print(f"\nprofile ({where}): {total:.1f} s")
        for k, v in profile["phases_s"].items():
            print(f"  {k}: {v:.2f} s ({v / total:.0%})")
        for e in profile["top_ops"]:
            print(f"  {e['op']}: {e['self_s']:.2f} s ({e['share']:.0%})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1, help="optimizer steps of 8 pairs per method")
    parser.add_argument(
        "--warmup", type=int, default=0, help="leading steps not timed (0: a step takes minutes; see the doc)"
    )
    parser.add_argument("--pairs", type=int, default=400, help="pairs generated (the length profile)")
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS), choices=METHODS)
    parser.add_argument("--repeats", type=int, default=1, help="fresh processes per method, interleaved; median")
    parser.add_argument("--profile", default="shared_prompt", choices=("shared_prompt", "separate", "none"))
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--json", default=None, help="where to write the JSON result (default: WORK/result.json)")
    parser.add_argument(
        "--summarize", action="store_true", help="run nothing: summarize the results saved in WORK/results"
    )
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="dpo-realistic-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    info = prepare(work, args.pairs, args.steps, args.seed)
    if args.child:
        saved = work / "results"  # each method's result also survives an interrupted parent (--summarize)
        saved.mkdir(exist_ok=True)
        try:
            result = child(args.child, work, args.steps, args.warmup, info)
        except (MemoryError, RuntimeError) as error:
            failed = {"failed": 1, "reason": f"{type(error).__name__}: {str(error)[:300]}"}
            (saved / f"{args.child}.{os.getpid()}.json").write_text(json.dumps(failed))
            raise
        (saved / f"{args.child}.{os.getpid()}.json").write_text(json.dumps(result))
        harness.emit(result)
        return
    started = time.perf_counter()
    peaks = [_spawn("matmul", args, work)]
    runs: dict[str, list] = {m: [] for m in args.methods}
    profile = None
    if args.summarize:  # the results a previous (interrupted) run left in WORK/results
        for path in sorted((work / "results").glob("*.json")):
            method = path.name.split(".")[0]
            if method.startswith("profile-"):
                profile = json.loads(path.read_text())
            elif method in runs:
                runs[method].append(json.loads(path.read_text()))
        runs = {m: rs for m, rs in runs.items() if rs}
    for rep in range(0 if args.summarize else args.repeats):
        for method in args.methods:
            r = _spawn(method, args, work)
            runs[method].append(r)
            if "failed" not in r:
                print(f"[{rep}] {method}: {r['pairs_per_s']:.4f} pairs/s, {r['wall_s']:.0f} s", flush=True)
    peaks.append(_spawn("matmul", args, work))
    if args.profile != "none" and not args.summarize:
        profile = _spawn(f"profile-{args.profile}", args, work)
    peak_info = max(peaks, key=lambda p: p.get("peak", 0))
    results = {m: _median_result(rs) for m, rs in runs.items()}
    summary = summarize(info, results, peak_info["peak"], args.steps, args.warmup)
    _print(info, peak_info, summary, profile)
    doc = {
        "args": vars(args),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "nproc": os.cpu_count(),
        "wall_s": time.perf_counter() - started,
        "data": info,
        "matmul": peaks,
        "summary": summary,
        "profile": profile,
        "runs": runs,
    }
    target = Path(args.json) if args.json else work / "result.json"
    target.write_text(json.dumps(doc, indent=1))
    print(f"\nJSON written to {target}")


if __name__ == "__main__":
    main()
