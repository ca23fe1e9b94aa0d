"""Long pairs in bounded memory (issue 35): peak RSS and seconds per step of `dpo-train` (chunked vocabulary head,
both layouts, and the whole head as before) against TRL 1.16 `DPOTrainer` (its default fused head), 1 pair a step.

Every configuration runs in a fresh interpreter (`harness.call`), so each peak is its own: the lifetime peak
(`ru_maxrss`) and the highest RSS sampled every 5 ms from the first micro-batch (ours) or the first step's
begin (TRL) to the end of training. Both sides train the same token ids: plain-text pairs of single-token
words (a 256-token prompt and two completions of L tokens, EOS included) built with `dpo-data build`'s own
`build`, our loader's order handed to TRL as pre-tokenized rows. Both: fp32 on CPU, sigmoid, beta 0.1, AdamW
lr 1e-5 constant, clipping 1.0, live reference, activation checkpointing (TRL's default; ours
`train.activation_checkpointing: true`), 1 pair per step, `--steps` steps; a step's seconds are ours'
`pairs / pairs/s` of metrics.jsonl and TRL's `on_step_begin` to `on_step_end`; the step-1 loss must be log 2
on every side (policy = reference).

Parts:
- smollm2: SmolLM2-135M-Instruct at completion lengths `--smol-lengths`: ours `separate` and `shared_prompt`
  at `--budget` MiB, ours `separate` with the whole head (`logits_budget_mib: null`, today), TRL; and ours
  `separate` at each of `--speed-budgets` (seconds per step against today: the default budget's choice).
- narrow: a random Llama with SmolLM2's vocabulary (hidden 64, 2 layers, tied head; saved once with the
  tokenizer's files) at `--narrow-lengths`, the same sides; a side whose earlier length failed is not run
  longer.
- limit: on the narrow model (or SmolLM2-135M-Instruct, `--limit-model smollm2`), the longest completion each
  side trains one step of under an address-space limit of `--limit-gib` (RLIMIT_AS set in the child: this
  machine's cgroups are v1 and not ours to change), found by doubling (TRL from `--limit-start`; ours from
  1.5x TRL's longest, the issue's target) up to `--limit-max`, then bisecting to `--resolution` tokens, each
  try a fresh process judged passed (it trained) or failed (it did not: MemoryError, "can't allocate memory",
  killed). RLIMIT_AS counts virtual memory (the interpreter, libraries, thread stacks and allocator
  reservations never touched), so it is stricter than an RSS limit of the same size, about alike for both
  sides.

`--mlp-tile T` (a count or `auto`) adds `ours:separate:BUDGET:T` and `ours:shared_prompt:BUDGET:T`
(train.mlp_tile_tokens: T) to the tables, and makes ours' side of `limit` tiled.

`--live` adds each configuration's peak of live tensor bytes on the CPU (`tests.harness.LiveTensors`: the
profiler's record of every allocation and free, from before the model loads): what `torch.cuda.max_memory_allocated`
counts on a GPU, without the host allocator's retention that RSS includes. The profiler slows a step.

Measurement children run under an address-space cap of `--cap-gib` (default 10) so that no configuration takes
the shared machine past it; a configuration that needs more fails and is reported failed.

With `--device cuda` both sides train fp32 on the GPU, and a child's limit (`--limit-gib`, `--cap-gib`) is the
CUDA caching allocator's (`torch.cuda.set_per_process_memory_fraction`: the tensors both trainers allocate,
not the CUDA context) instead of RLIMIT_AS (CUDA maps far more address space than it uses); each line adds
the GPU's peak allocated and reserved memory. `--tokenizer DIR` builds the narrow model and the data with the
tokenizer files in DIR (SmolLM2's, byte for byte) where the bundled model is not installed.

    nice -n 10 .venv/bin/python benchmarks/long_pairs.py [--parts smollm2 narrow limit] [--steps 2]
    python benchmarks/long_pairs.py --device cuda --tokenizer DIR --parts limit --limit-start 65536 \
        --limit-max 524288
"""

from __future__ import annotations

import argparse
import json
import math
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

import harness
from trl_peer import HYPER, train_timed, trl_trainer

PROMPT = 256
ENV = {
    "TRANSFORMERS_VERBOSITY": "error",
    "TOKENIZERS_PARALLELISM": "false",
    "HF_HUB_OFFLINE": "1",
    "USE_HUB_KERNELS": "NO",  # both sides run the model's own code (ours sets it anyway; offline, TRL would fail)
}
NARROW = {
    "model_type": "llama",
    "hidden_size": 64,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "tie_word_embeddings": True,
}
SAMPLE_S = 0.005


# ---------------------------------------------------------------- data and models (parent)


def tokenizer_dir(given: str | None) -> Path:
    """The directory whose tokenizer files build the data: `given`, or the bundled SmolLM2's."""
    from dpo_train.model.bundled import materialize_smollm2

    return Path(given) if given else Path(materialize_smollm2())


def narrow_model(work: Path, tokenizer: str | None) -> str:
    """WORK/narrow: the random Llama of NARROW with SmolLM2's vocabulary (seed 0) and the tokenizer's own files."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    smollm2, out = tokenizer_dir(tokenizer), work / "narrow"
    if not (out / "config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(smollm2)
        ids = {k: getattr(tokenizer, k) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
        spec = {k: v for k, v in NARROW.items() if k != "model_type"}
        config = AutoConfig.for_model("llama", **spec, vocab_size=len(tokenizer), **ids)
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out)
        for f in smollm2.iterdir():  # byte for byte: the data's tokenizer attestation holds for this model
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
                shutil.copy(f, out / f.name)
    return str(out)


def dataset(work: Path, length: int, pairs: int, tokenizer: str | None = None) -> str:
    """WORK/data-LENGTH: `pairs` plain-text pairs, a 256-token prompt and two different completions of `length`
    tokens (length - 1 single-token words and the EOS the build appends), built with SmolLM2's tokenizer."""
    import random

    from transformers import AutoTokenizer

    from dpo_data.dataset.store import PairStore

    out = work / f"data-{length}x{pairs}"
    if (out / "manifest.json").is_file():
        return str(out)
    model = str(tokenizer_dir(tokenizer))
    tokenizer = AutoTokenizer.from_pretrained(model)
    words = [w for w in dict.fromkeys(harness._WORDS) if len(tokenizer.encode(" " + w)) == 1]
    rng = random.Random(length)

    def text(n: int) -> str:
        return " " + " ".join(rng.choice(words) for _ in range(n))

    rows = [{"prompt": text(PROMPT), "chosen": text(length - 1), "rejected": text(length - 1)} for _ in range(pairs)]
    harness.write_jsonl(out.with_suffix(".jsonl"), rows)
    harness.build_dataset([out.with_suffix(".jsonl")], model, out)
    store = PairStore([str(out)])
    got = {(len(p.prompt), len(p.chosen), len(p.rejected)) for p in map(store.pair, range(store.num_pairs))}
    if got != {(PROMPT, length, length)} or store.num_pairs != pairs:
        raise SystemExit(f"{out.name}: lengths {got}, pairs {store.num_pairs}; wanted {(PROMPT, length, length)}")
    return str(out)


# ---------------------------------------------------------------- one configuration (child)


def _order(data: str, steps: int, tokens: int) -> list[int]:
    """The pair of each step, as our loader (1 pair a step) picks it."""
    from dpo_data import LoaderConfig
    from dpo_data.loading.loader import DPOLoader

    order: list[int] = []
    for batch in DPOLoader([data], LoaderConfig(batching="pairs", pairs_per_step=1, max_tokens_per_microbatch=tokens)):
        order += batch["pair_index"].tolist()
        if len(order) >= steps:  # the loader runs epoch after epoch: stop at the trained steps
            return order[:steps]
    return order


def _tokens(length: int) -> int:
    """A micro-batch budget that holds one separate pair (2 prompts and both completions)."""
    return 2 * (PROMPT + length) + 64


def run(
    side: str, model: str, data: str, length: int, steps: int, work: str, limit_gib: float, device: str, live: bool
) -> dict:
    """One configuration in this (fresh) process under a memory limit of `limit_gib` (RLIMIT_AS on the CPU, the
    caching allocator's on CUDA). `side`: `trl`, or `ours:LAYOUT:BUDGET[:TILE]` (BUDGET in MiB, or `null` for
    the whole head; TILE: train.mlp_tile_tokens, a count or `auto`; none: null). `live`: also the peak of live
    tensor bytes on the CPU (`tests.harness.LiveTensors`, from before the model loads)."""
    import contextlib

    import torch

    limit = int(limit_gib * (1 << 30))
    if device == "cuda":
        torch.cuda.set_per_process_memory_fraction(min(1.0, limit / torch.cuda.get_device_properties(0).total_memory))
    else:
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    sampler = harness.RssSampler(SAMPLE_S)
    out = Path(work) / side.replace(":", "-")
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    meter = contextlib.nullcontext()
    if live:
        sys.path.append(str(harness.ROOT))  # after PYTHONPATH: another checkout given there keeps its dpo_train
        from tests.harness import LiveTensors

        meter = LiveTensors()
    with meter:
        if side == "trl":
            got = _run_trl(model, data, length, steps, out, sampler, device)
        else:
            _, layout, budget, *tile = side.split(":")
            budget = None if budget == "null" else int(budget)
            tile = (tile[0] if tile[0] == "auto" else int(tile[0])) if tile else None
            got = _run_ours(model, data, length, steps, out, layout, budget, tile, sampler, device)
    if live:
        got["live_peak_mib"] = meter.peak_mib
    if device == "cuda":
        got["cuda_allocated_mib"] = torch.cuda.max_memory_allocated() / (1 << 20)
        got["cuda_reserved_mib"] = torch.cuda.max_memory_reserved() / (1 << 20)
    got["sampled_peak_mib"] = sampler.stop() / (1 << 20)
    got["peak_rss_mib"] = harness.peak_rss_mib()
    with open("/proc/self/status") as f:
        got["peak_vm_mib"] = next(int(x.split()[1]) for x in f if x.startswith("VmPeak")) / 1024
    return got


def _run_ours(model, data, length, steps, out, layout, budget, tile, sampler, device) -> dict:
    from dpo_train.config.loading import load_config
    from dpo_train.trainer import Trainer, train

    config = {
        "model": {"path": model},
        "reference": {"mode": "live"},
        "data": {
            "path": data,
            "batching": "pairs",
            "pairs_per_step": 1,
            "max_tokens_per_microbatch": _tokens(length),
            "layout": layout,
        },
        "loss": {"type": "sigmoid", "beta": HYPER["beta"]},
        "optim": {"lr": HYPER["lr"], "scheduler": "constant", "max_grad_norm": 1.0},
        "train": {
            "output_dir": str(out),
            "max_steps": steps,
            "precision": "fp32",
            "activation_checkpointing": True,
            "logits_budget_mib": budget,
            "mlp_tile_tokens": tile,
        },
        "distributed": {"device": device},
    }
    microbatch = Trainer.microbatch

    def sampled(self, batch):  # sample from the first micro-batch on: the steps, not the loading
        sampler.on = True
        return microbatch(self, batch)

    Trainer.microbatch = sampled
    train(load_config(config), progress=False)
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return {
        "step_seconds": [r["pairs"] / r["pairs/s"] for r in rows],
        "losses": [r["loss"] for r in rows],
        "input_tokens": [r.get("input_tokens") for r in rows],
    }


def _run_trl(model, data, length, steps, out, sampler, device) -> dict:
    from transformers import TrainerCallback

    from dpo_data.dataset.store import PairStore

    store = PairStore([data])
    pairs = [store.pair(i) for i in _order(data, steps, _tokens(length))]
    trainer = trl_trainer(model, pairs, out, 1, steps, precomputed=False, pairs_per_step=1, device=device)
    begins: list[float] = []

    class Clock(TrainerCallback):
        def on_step_begin(self, *a, **k):
            sampler.on = True
            begins.append(time.perf_counter())

    trainer.add_callback(Clock())
    ends, logs = train_timed(trainer)
    return {
        "step_seconds": [b - a for a, b in zip(begins, ends)],
        "losses": [e["loss"] for e in logs],
        "input_tokens": [2 * (PROMPT + length)] * len(logs),
    }


# ---------------------------------------------------------------- parent


def measure(side: str, model: str, data: str, length: int, args, work: Path, limit_gib: float, steps: int) -> dict:
    """`run` in a fresh interpreter; a failure is a result (`failed`, its last stderr line), not an exit."""
    started = time.perf_counter()
    try:
        call = (side, model, data, length, steps, str(work), limit_gib, args.device, args.live)
        got = harness.call(run, *call, env=ENV)
    except harness.ChildFailed as failed:
        lines = [x for x in failed.stderr.splitlines() if x.strip()] or ["?"]
        got = {"failed": failed.returncode, "reason": lines[-1][:200]}
    got["wall_s"] = round(time.perf_counter() - started, 1)
    return got


def _line(part: str, model_name: str, length: int, side: str, got: dict) -> str:
    head = f"{part:8} {model_name:8} L={length:6d} {side:24}"
    if "failed" in got:
        return f"{head} FAILED (rc {got['failed']}): {got['reason']}  [{got['wall_s']} s]"
    steps = " ".join(f"{s:.2f}" for s in got["step_seconds"])
    gpu = ""
    if "cuda_reserved_mib" in got:
        gpu = f"GPU {got['cuda_allocated_mib']:.0f} / {got['cuda_reserved_mib']:.0f} MiB, "
    if "live_peak_mib" in got:
        gpu += f"live tensors {got['live_peak_mib']:.0f} MiB, "
    return (
        f"{head} {gpu}peak {got['peak_rss_mib']:8.0f} MiB, sampled {got['sampled_peak_mib']:8.0f} MiB, "
        f"VmPeak {got['peak_vm_mib']:8.0f} MiB, s/step {steps}, step-1 loss {got['losses'][0]:.6f}  [{got['wall_s']} s]"
    )


def sides(budget: int, tile: int | str | None = None) -> list[str]:
    tiled = [f"ours:{layout}:{budget}:{tile}" for layout in ("separate", "shared_prompt")] if tile else []
    return [f"ours:separate:{budget}", f"ours:shared_prompt:{budget}", *tiled, "ours:separate:null", "trl"]


def part_table(part, model, model_name, lengths, extra, args, work, results) -> None:
    """Every side at every length (a side that failed at a shorter length is not run longer)."""
    failed: set[str] = set()
    for length in lengths:
        data = dataset(work, length, args.steps, args.tokenizer)
        for side in sides(args.budget, args.mlp_tile) + (extra if length in args.speed_lengths else []):
            if side in failed or (args.sides and side not in args.sides):
                continue
            got = measure(side, model, data, length, args, work, args.cap_gib, args.steps)
            results.append({"part": part, "model": model_name, "length": length, "side": side, **got})
            print(_line(part, model_name, length, side, got), flush=True)
            if "failed" in got:
                failed.add(side)


def longest(side: str, model: str, name: str, args, work: Path, results: list, start: int) -> tuple[int, bool]:
    """The longest completion `side` trains 1 step of `model` (called `name`) under the limit of `--limit-gib`:
    doubling from `start` until a try fails or passes at `--limit-max`, then bisecting to `--resolution` tokens.
    (0 when `start` fails; True when the longest is only a floor: it passed at `--limit-max`, longer was not
    tried.)"""

    def passes(length: int) -> bool:
        got = measure(side, model, dataset(work, length, 1, args.tokenizer), length, args, work, args.limit_gib, 1)
        results.append({"part": "limit", "model": name, "length": length, "side": side, **got})
        print(_line("limit", name, length, side, got), flush=True)
        return "failed" not in got

    good, bad, length = 0, None, start
    while bad is None:
        if not passes(length):
            bad = length
        elif length >= args.limit_max:
            return length, True
        else:
            good, length = length, min(2 * length, args.limit_max)
    while bad - good > args.resolution:
        middle = (good + bad) // 2 // 64 * 64
        if middle <= good:
            break
        good, bad = (middle, bad) if passes(middle) else (good, middle)
    return good, False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", nargs="+", default=["smollm2", "narrow", "limit"], help="run in this order")
    parser.add_argument("--steps", type=int, default=2, help="steps per configuration (the last is reported)")
    parser.add_argument("--smol-lengths", type=int, nargs="+", default=[512, 1024, 2048])
    parser.add_argument("--narrow-lengths", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384, 32768])
    parser.add_argument("--sides", nargs="*", default=None, help="only these sides in parts smollm2 and narrow")
    parser.add_argument("--budget", type=int, default=1024, help="logits_budget_mib of ours' chunked sides")
    parser.add_argument(
        "--mlp-tile",
        type=lambda v: v if v == "auto" else int(v),
        default=None,
        help="train.mlp_tile_tokens (a count or auto): one more side in tables, ours' in `limit`",
    )
    parser.add_argument("--speed-budgets", type=int, nargs="*", default=[256], help="more budgets, SmolLM2 only")
    parser.add_argument("--speed-lengths", type=int, nargs="*", default=[512, 2048], help="lengths of --speed-budgets")
    parser.add_argument("--limit-gib", type=float, default=8.0, help="the memory limit of part `limit`")
    parser.add_argument("--cap-gib", type=float, default=10.0, help="address-space cap of every other child")
    parser.add_argument("--resolution", type=int, default=1024, help="bisection stops within this many tokens")
    parser.add_argument("--limit-start", type=int, default=1024, help="part `limit`: TRL's first try")
    parser.add_argument(
        "--limit-model", default="narrow", choices=["narrow", "smollm2"], help="the model part `limit` trains"
    )
    parser.add_argument("--limit-max", type=int, default=32768, help="part `limit` tries no longer completion")
    parser.add_argument("--work", default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where both sides train (fp32)")
    parser.add_argument("--tokenizer", default=None, help="tokenizer of narrow and limit (default: SmolLM2)")
    parser.add_argument(
        "--live", action="store_true", help="also each side's peak of live CPU tensor bytes (the profiler's record)"
    )
    args = parser.parse_args()
    work = Path(args.work or tempfile.mkdtemp(prefix="dpo-long-pairs-"))
    work.mkdir(parents=True, exist_ok=True)
    results: list[dict] = []
    started = time.perf_counter()
    narrow_limit = "limit" in args.parts and args.limit_model == "narrow"
    narrow = narrow_model(work, args.tokenizer) if "narrow" in args.parts or narrow_limit else None
    limits = {}
    for part in args.parts:  # in the order given
        if part == "smollm2":
            from dpo_train.model.bundled import materialize_smollm2

            extra = [f"ours:separate:{b}" for b in args.speed_budgets if b != args.budget]
            part_table("smollm2", str(materialize_smollm2()), "smollm2", args.smol_lengths, extra, args, work, results)
        elif part == "narrow":
            part_table("narrow", narrow, "narrow", args.narrow_lengths, [], args, work, results)
        elif part == "limit":
            # TRL first; ours then starts at 1.5x TRL's longest (the target), doubling from there
            name, start = args.limit_model, args.limit_start
            limit_model = narrow if narrow_limit else str(tokenizer_dir(None))  # the bundled SmolLM2
            trl = longest("trl", limit_model, name, args, work, results, start)
            limits["trl"] = trl
            ours = f"ours:separate:{args.budget}" + (f":{args.mlp_tile}" if args.mlp_tile else "")
            target = max(start, -(-3 * trl[0] // 2 // 64) * 64)
            limits[ours] = longest(ours, limit_model, name, args, work, results, target)
            for side, (tokens, floor) in limits.items():
                floor = "at least " if floor else ""
                print(f"limit: {side} trains {floor}{tokens} completion tokens under {args.limit_gib} GiB", flush=True)
    losses = [r["losses"][0] for r in results if "losses" in r]
    summary = {
        "limits": limits,
        "step-1 max |loss - log 2|": max((abs(x - math.log(2)) for x in losses), default=None),
        "wall_s": round(time.perf_counter() - started, 1),
        "python": sys.version.split()[0],
        "device": args.device,
    }
    print(json.dumps(summary))
    print("JSON " + json.dumps({"results": results, "summary": summary}))


if __name__ == "__main__":
    main()
