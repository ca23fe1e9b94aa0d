"""GPU training throughput against TRL 1.16 (issue 56): ours' layouts, attention paths and reference modes against
`DPOTrainer` at its default and its fastest valid setting, on one device, in one run, with bf16 MFU.

Every method trains the same pairs in the same order (`realistic_throughput.py`'s generated conversational set with
the length profile of UltraFeedback-like data, its training subset, our loader's step order handed to TRL as
pre-tokenized rows), the same hyper-parameters (sigmoid, beta 0.1, AdamW lr 1e-5 constant, clipping 1.0), on a
Llama-architecture model of about 1B parameters built from a config with random weights (hidden 2048, 16 layers,
32 heads, 8 KV heads, MLP 8192, SmolLM2's vocabulary, tied head; weights do not change the speed), saved once to
WORK with SmolLM2's tokenizer files so both trainers load the same directory. Both sides: bf16 autocast over fp32
master weights (ours `train.precision: bf16`, TRL `bf16=True`), activation checkpointing (ours
`train.activation_checkpointing`, TRL `gradient_checkpointing`), each method in a fresh process, `--warmup` steps
untimed (their seconds, compiles included, reported apart), then the timed steps (on CUDA every clock reading
waits for the device: ours' step records through their synchronizing reads of the loss and gradient norm, TRL's
through a callback that synchronizes).

Methods (`--methods`): `ours-LAYOUT-ATTENTION-REFERENCE` (LAYOUT separate | shared, ATTENTION a `model.attention`
value of PATHS, or `fastest`: the path whose live run of that layout was fastest in this run; REFERENCE live |
precomputed) and `trl-SETTING-REFERENCE` (SETTING `default`: TRL's own per-device batch of 8 pairs, one
micro-batch per step at 8 pairs a step, its default attention; `bN`: N pairs per micro-batch, the step's pairs by
accumulation, with flash attention 2 and `padding_free=True` where TRL allows them: flash-attn importable, CUDA,
bf16; TRL 1.16 switches padding_free off itself and the result says so). TRL's fastest valid setting is the best
of its measured settings. A path this checkout does not have, or that refuses on this device, is reported as
refused with its one-line reason.

Reported per method: pairs/s, tokens/s (the pairs' own tokens in the separate layout, the same work for every
method; and the tokens fed, padding and the shared prompt included), tokens per micro-batch, useful and hardware
MFU against a `--device` matmul peak of the run's dtype measured in the same run (`realistic_throughput`'s FLOP
model; hardware adds the recompute forward of the decoder layers under activation checkpointing), peak memory
(`torch.cuda.max_memory_allocated` on CUDA, peak RSS on the CPU), and the ratios ours / TRL fastest, ours / TRL
default, shared / separate and each path / segments; on CUDA, the issue's targets as met or not met.

    python benchmarks/gpu_throughput.py [--device cuda] [--steps 6] [--warmup 1] [--methods ...] [--json PATH]
    .venv/bin/python benchmarks/gpu_throughput.py --device cpu --tiny   # the CPU smoke run (fp32, tiny model)
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import re
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import harness
from realistic_throughput import (
    MEMORY_LIMIT,
    Setting,
    forward_flops,
    hardware_from_rows,
    matmul_peak,
    model_shape,
    ours_geometry,
    prepare,
    run_ours,
    run_trl,
    segment_score_pairs,
    useful_work,
)

LAYOUTS = {"separate": "separate", "shared": "shared_prompt"}
PATHS = {
    "segments": ("separate", "shared"),
    "flex": ("separate", "shared"),
    "varlen": ("separate",),  # torch's varlen_attn: cu_seqlens, no shared-prompt mask
    "sdpa": ("separate", "shared"),
}
"""The `model.attention` values measured and the layouts each serves: a new path is one entry."""
ROW_ATTENTION = {"sdpa"}  # scores every (query, key) pair of the row; the others only those segments see
TRL_DEFAULT_MICRO = 8  # DPOConfig's per_device_train_batch_size
TRL_SWEEP = (1, 2, 4, 8)
SHAPES = {  # Llama configs; the vocabulary is SmolLM2's tokenizer's, the head tied to the embeddings
    "1b": {
        "hidden_size": 2048,
        "num_hidden_layers": 16,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "intermediate_size": 8192,
    },
    "tiny": {
        "hidden_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "intermediate_size": 256,
    },
}
METHOD = re.compile(r"^(ours-(separate|shared)-([a-z_0-9]+)|trl-(default|b[0-9]+))-(live|precomputed)$")
TARGETS = {"trl_fastest": 3.0, "mfu_useful": 0.40, "tokens_per_microbatch": 8192, "shared_over_separate": 1.08}
MATMUL = {"cuda": ((4096, 8192, 16384), 10), "cpu": ((2048, 3072, 4096), 5), "tiny": ((512, 1024), 3)}
"""The square matmuls (sizes, repeats) whose best rate is the peak: the smoke run's small, for its time."""
ENV = {"TRANSFORMERS_VERBOSITY": "error", "TOKENIZERS_PARALLELISM": "false"}


def parse(method: str) -> dict:
    """`ours-shared-flex-live` -> side, layout, attention, reference; `trl-b4-live` -> side, micro, reference."""
    m = METHOD.match(method)
    if not m:
        raise argparse.ArgumentTypeError(f"method {method!r}: expected ours-LAYOUT-ATTENTION-REF or trl-SETTING-REF")
    if m.group(2):
        return {"side": "ours", "layout": m.group(2), "attention": m.group(3), "reference": m.group(5)}
    setting = m.group(4)
    micro = TRL_DEFAULT_MICRO if setting == "default" else int(setting[1:])
    return {"side": "trl", "setting": setting, "micro": micro, "reference": m.group(5)}


def default_methods(sweep: tuple[int, ...]) -> list[str]:
    """In the order a deadline should cut them last to first: segments and TRL's default (the comparison a short
    run must not lose), the other paths, TRL's sweep (largest batch first), then the precomputed reference on
    each layout's fastest path."""
    live = [f"ours-{layout}-{path}-live" for path, layouts in PATHS.items() for layout in layouts]
    trl = [f"trl-b{n}-live" for n in sorted(sweep, reverse=True)]
    return live[:2] + ["trl-default-live"] + live[2:] + trl + [f"ours-{x}-fastest-precomputed" for x in LAYOUTS]


# ---------------------------------------------------------------- the model and the run's setting


def build_model(work: Path, tiny: bool) -> tuple[str, int]:
    """WORK/model-(1b|tiny): a random Llama (seed 0) with SmolLM2's vocabulary and tokenizer files (byte for
    byte: the data's tokenizer attestation holds for it), saved once; its path and parameter count."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from dpo_train.model.bundled import materialize_smollm2

    size = "tiny" if tiny else "1b"
    smollm2, out = materialize_smollm2(), work / f"model-{size}"
    if not (out / "config.json").is_file():
        tokenizer = AutoTokenizer.from_pretrained(smollm2)
        ids = {k: getattr(tokenizer, k) for k in ("pad_token_id", "bos_token_id", "eos_token_id")}
        spec = {**SHAPES[size], "tie_word_embeddings": True, "vocab_size": len(tokenizer), **ids}
        torch.manual_seed(0)
        dtype = torch.float32 if tiny else torch.bfloat16  # half the bytes to write; both sides load fp32
        AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **spec), dtype=dtype).save_pretrained(out)
        for f in Path(smollm2).iterdir():
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template", "vocab", "merges")):
                shutil.copy(f, out / f.name)
    return str(out), _parameters(out)


def _parameters(model: Path) -> int:
    from safetensors import safe_open

    total = 0
    for f in model.glob("*.safetensors"):
        with safe_open(str(f), "pt") as st:
            total += sum(math.prod(st.get_slice(k).get_shape()) for k in st.keys())
    return total


def run_info(args) -> dict:
    """The data (`realistic_throughput.prepare`, cached in WORK) and this run's model and micro-batch budget."""
    info = prepare(args.work, args.pairs, args.steps, args.seed, args.pairs_per_step)
    model, parameters = build_model(args.work, args.tiny)
    return {**info, "model": model, "parameters": parameters, "budget": max(info["budget"], args.budget)}


def precision(device: str) -> str:
    """bf16 on CUDA, as each side runs it; fp32 on the CPU (bf16 there is slow, and TRL refuses it)."""
    return "bf16" if device == "cuda" else "fp32"


def flash_usable(device: str) -> bool:
    """Where TRL may run flash attention 2 and padding_free: CUDA, bf16, the flash-attn package importable."""
    return device == "cuda" and importlib.util.find_spec("flash_attn") is not None


# ---------------------------------------------------------------- one method (child process)


def child(method: str, args, info: dict) -> dict:
    """One method in this fresh process; ours' refusal (the project's error family) is a result, not a crash."""
    from dpo_state.errors import ToolkitError

    if args.device == "cpu":
        resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
    if method == "matmul":
        sizes, repeats = MATMUL["tiny" if args.tiny and args.device == "cpu" else args.device]
        return matmul_peak(sizes, repeats, "bfloat16" if args.device == "cuda" else "float32", args.device)
    spec, started = parse(method), time.perf_counter()
    try:
        got = _run_ours(spec, args, info) if spec["side"] == "ours" else _run_trl(spec, args, info)
    except ToolkitError as error:
        return {"refused": str(error).strip().splitlines()[0][:300]}
    steps = sum(got["step_seconds"])
    got["warmup_s"] = sum(got["step_seconds"][: args.warmup])
    got["setup_s"] = time.perf_counter() - started - steps  # loading, checks, precompute, export: not timed
    if args.device == "cuda":
        import torch

        got["peak_gpu_mib"] = torch.cuda.max_memory_allocated() / (1 << 20)
    return got


def _run_ours(spec: dict, args, info: dict) -> dict:
    # read_back off and a bf16 export: the run's end costs seconds, not a second load of the model
    extra = (("activation_checkpointing", True), ("read_back", False), ("export_dtype", "bf16"))
    setting = Setting(args.device, precision(args.device), spec["attention"], args.pairs_per_step, extra)
    layout, precomputed = LAYOUTS[spec["layout"]], spec["reference"] == "precomputed"
    got = run_ours(info, args.work, args.steps, args.warmup, layout, precomputed, setting)
    got["attention"] = spec["attention"]
    flex = sys.modules.get("dpo_train.attention.flex")  # its compiles, where the path ran (issue 56, item 1)
    if spec["attention"] == "flex" and hasattr(flex, "compiles"):
        got["flex_compiles"] = flex.compiles()
    shutil.rmtree(args.work / f"ours-{layout}-{precomputed}", ignore_errors=True)  # its export: GBs at 1B
    return got


def trl_micro(spec: dict, pairs_per_step: int) -> int:
    """TRL's pairs per micro-batch: its default batch of 8 at most the step's pairs (one micro-batch a step)."""
    return min(spec["micro"], pairs_per_step) if spec["setting"] == "default" else spec["micro"]


def _run_trl(spec: dict, args, info: dict) -> dict:
    micro = trl_micro(spec, args.pairs_per_step)
    speed = {"gradient_checkpointing": True}
    if spec["setting"] != "default" and flash_usable(args.device):
        speed |= {"attn_implementation": "flash_attention_2", "padding_free": True}
    setting = Setting(args.device, precision(args.device), pairs_per_step=args.pairs_per_step)
    got = run_trl(info, args.work, args.steps, args.warmup, micro, spec["reference"] == "precomputed", setting, speed)
    got["attention"] = speed.get("attn_implementation", "default")
    got["micro"] = micro
    return got


# ---------------------------------------------------------------- the parent


def _attention_values() -> set[str]:
    schema = json.loads((harness.ROOT / "schemas" / "train-config.schema.json").read_text())
    return set(schema["properties"]["model"]["properties"]["attention"]["enum"])


def resolve(method: str, results: dict, args) -> tuple[str, dict | None]:
    """The method to spawn (`fastest`: the layout's fastest live path so far), or why it is not run: a result
    `{"skipped": why}` or `{"refused": why}`."""
    spec = parse(method)
    if spec["side"] == "trl":
        if spec["setting"] != "default" and spec["micro"] == TRL_DEFAULT_MICRO and not flash_usable(args.device):
            return method, {"skipped": "the same setting as trl-default (TRL has no flash attention here)"}
        if args.pairs_per_step % trl_micro(spec, args.pairs_per_step):
            why = f"{spec['micro']} pairs per micro-batch do not divide {args.pairs_per_step} pairs a step"
            return method, {"skipped": why}
        return method, None
    if spec["attention"] == "fastest":
        ok = {m: r["pairs_per_s"] for m, r in results.items() if "pairs_per_s" in r and m.endswith("-live")}
        ok = {m: v for m, v in ok.items() if m.startswith(f"ours-{spec['layout']}-")}
        if not ok:
            return method, {"skipped": f"no live path of the {spec['layout']} layout trained in this run"}
        spec["attention"] = parse(max(ok, key=ok.get))["attention"]
        method = f"ours-{spec['layout']}-{spec['attention']}-{spec['reference']}"
    if spec["attention"] not in _attention_values():
        why = f"model.attention {spec['attention']} is not a value of this checkout (schemas/train-config.schema.json)"
        return method, {"refused": why}
    return method, None


def spawn(method: str, args) -> dict:
    """One method in a fresh process (this script's --child); a failure is recorded, not fatal."""
    argv = [__file__, "--child", method, "--device", args.device, "--steps", args.steps, "--warmup", args.warmup]
    argv += ["--pairs", args.pairs, "--pairs-per-step", args.pairs_per_step, "--budget", args.budget]
    argv += ["--seed", args.seed, "--work", args.work] + (["--tiny"] if args.tiny else [])
    started = time.perf_counter()
    try:
        result = harness.run_child(argv, ENV, label=method)
    except harness.ChildFailed as failed:
        reason = ([x for x in failed.stderr.splitlines() if x.strip()] or ["?"])[-1][:300]
        result = {"failed": failed.returncode, "reason": reason}
    result["wall_s"] = time.perf_counter() - started
    return result


def run_methods(args, started: float) -> dict:
    """Each method once, in order; past `--deadline-s` (judged by the children's median wall time so far) the
    rest are reported skipped, so a device call's time limit ends with a summary, not a kill."""
    results: dict[str, dict] = {}
    walls: list[float] = []
    for asked in args.methods:
        method, instead = resolve(asked, results, args)
        expected = statistics.median(walls) if walls else 0.0
        if instead is None and args.deadline_s and time.perf_counter() - started + expected > args.deadline_s:
            instead = {"skipped": f"the run's deadline of {args.deadline_s:.0f} s would pass"}
        if instead is None:
            instead = spawn(method, args)
            walls.append(instead["wall_s"])
        results[method] = instead
        print(f"{method}: {_brief(instead)}", flush=True)
    return results


def _brief(r: dict) -> str:
    if "pairs_per_s" in r:
        return f"{r['pairs_per_s']:.3f} pairs/s, {r['wall_s']:.0f} s"
    if "failed" in r:
        return f"failed (rc {r['failed']}): {r['reason']}"
    return "; ".join(f"{k}: {v}" for k, v in r.items() if k != "wall_s")


# ---------------------------------------------------------------- the summary


def summarize(info: dict, results: dict, peak: float, args) -> dict:
    """Per method: throughput, MFU (useful: the same FLOPs for every method; hardware: what it computed), memory;
    then the ratios and the targets."""
    shape = model_shape(info["model"])
    geometry = {
        layout: [
            g
            for g in ours_geometry(info["data"], LAYOUTS[layout], args.steps, info["budget"], args.pairs_per_step)
            if g["step"] >= args.warmup
        ]
        for layout in LAYOUTS
    }
    order = [p for g in geometry["separate"] for p in g["pairs"]]
    useful = useful_work(info["data"], order, shape)
    useful_fwd = forward_flops(shape, useful["tokens"], useful["supervised"], useful["score_pairs"])
    table = {}
    for method, r in results.items():
        if "pairs_per_s" not in r:
            table[method] = {k: v for k, v in r.items() if k in ("refused", "skipped", "failed", "reason")}
            continue
        table[method] = _row(method, r, geometry, useful, useful_fwd, shape, peak, len(order), args)
    return {
        "model_shape": shape,
        "parameters": info["parameters"],
        "timed_pairs": len(order),
        "useful_tokens_per_pair": useful["tokens"] / max(len(order), 1),
        "table": table,
        "ratios": ratios(table),
        "targets": targets(table, args.device),
    }


def _row(method, r, geometry, useful, useful_fwd, shape, peak, n, args) -> dict:
    spec = parse(method)
    if spec["side"] == "ours":
        timed = geometry[spec["layout"]]
        rows = [(g["row"], 1) for g in timed]
        score = None if spec["attention"] in ROW_ATTENTION else sum(segment_score_pairs(g) for g in timed)
    else:
        rows = [tuple(x) for x in r["padded"][args.pairs_per_step // r["micro"] * args.warmup :]]
        score = None  # TRL: attention over the whole padded row
    hardware = hardware_from_rows(rows, useful["supervised"], score)
    passes = 4 if spec["reference"] == "live" else 3  # policy forward + backward (3 forwards), + reference forward
    recompute = forward_flops(shape, hardware["tokens"], 0, hardware["score_pairs"])  # checkpointing: no head
    hardware_flops = passes * forward_flops(shape, hardware["tokens"], useful["supervised"], hardware["score_pairs"])
    seconds = n / r["pairs_per_s"]
    return {
        "attention": r.get("attention"),
        "pairs_per_s": r["pairs_per_s"],
        "tokens_per_s": useful["tokens"] / seconds,
        "fed_tokens_per_s": hardware["tokens"] / seconds,
        "tokens_per_microbatch": hardware["tokens"] / max(len(rows), 1),
        "mfu_useful": passes * useful_fwd / seconds / peak,
        "mfu_hardware": (hardware_flops + recompute) / seconds / peak,
        "peak_mib": r.get("peak_gpu_mib", r["peak_rss_mib"]),
        "peak_kind": "gpu allocated" if "peak_gpu_mib" in r else "rss",
        "warmup_s": r["warmup_s"],
        "setup_s": r["setup_s"],
        "step_seconds": r["step_seconds"],
        "step1_loss": r["losses"][0],
        **{k: r[k] for k in ("flex_compiles", "padding_free", "micro") if k in r},
    }


def _ok(table: dict) -> dict:
    return {m: v for m, v in table.items() if "pairs_per_s" in v}


def _best(table: dict, prefix: str, reference: str, key: str = "pairs_per_s") -> str | None:
    """The measured method named `prefix`...`-reference` with the highest `key`."""
    found = {m: v[key] for m, v in _ok(table).items() if m.startswith(prefix) and m.endswith(f"-{reference}")}
    return max(found, key=found.get) if found else None


def ratios(table: dict) -> dict:
    """pairs/s of ours over TRL's fastest and default (same reference), shared over separate, a path over segments."""
    ok, out = _ok(table), {}
    for method in ok:
        spec = parse(method)
        if spec["side"] != "ours":
            continue
        reference = spec["reference"]
        fastest, default = _best(table, "trl-", reference), f"trl-default-{reference}"
        pairs = [(f"{method} / TRL fastest ({fastest})", fastest), (f"{method} / TRL default", default)]
        if spec["layout"] == "shared":
            pairs.append((None, f"ours-separate-{spec['attention']}-{reference}"))
        pairs.append((None, _segments_of(method)))
        for label, other in pairs:
            if _div(ok, method, other) is not None and other != method:
                out[label or f"{method} / {other}"] = round(_div(ok, method, other), 3)
    return out


def _segments_of(method: str) -> str:
    """ours-shared-flex-live -> ours-shared-segments-live: the path every other is held against."""
    spec = parse(method)
    return f"ours-{spec['layout']}-segments-{spec['reference']}"


def over_segments(table: dict) -> dict:
    """Each ours path's pairs/s over the segment path's, same layout and reference."""
    ok = _ok(table)
    paths = [m for m in ok if m.startswith("ours-") and parse(m)["attention"] != "segments"]
    return {m: _div(ok, m, _segments_of(m)) for m in paths if _segments_of(m) in ok}


def targets(table: dict, device: str) -> dict:
    """The issue's targets from this run's table; judged (met / not met) on CUDA only."""
    ok, out = _ok(table), {}
    live = _best(table, "ours-", "live")
    out["ours >= 3x TRL's fastest (pairs/s, live)"] = _target(
        _div(ok, live, _best(table, "trl-", "live")), TARGETS["trl_fastest"]
    )
    pre = _best(table, "ours-", "precomputed", "mfu_useful")
    mfu = _target(ok[pre]["mfu_useful"] if pre else None, TARGETS["mfu_useful"])
    tokens = ok[pre]["tokens_per_microbatch"] if pre else None
    if tokens is not None and tokens < TARGETS["tokens_per_microbatch"]:
        mfu["met"] = False  # measured on smaller micro-batches than the target's
    mfu |= {"method": pre, "tokens_per_microbatch": tokens, "live": ok[live]["mfu_useful"] if live else None}
    out[">= 40 % useful MFU, precomputed, >= 8k tokens per micro-batch"] = mfu
    shared, separate = _best(table, "ours-shared-", "live"), _best(table, "ours-separate-", "live")
    out["shared_prompt >= 1.08x separate (live)"] = _target(_div(ok, shared, separate), TARGETS["shared_over_separate"])
    against = over_segments(table)
    out["no attention path slower than segments"] = _target(min(against.values(), default=None), 1.0)
    out["no attention path slower than segments"]["by_path"] = against
    for entry in out.values():
        entry["judged"] = device == "cuda"
    return out


def _div(ok: dict, a: str | None, b: str | None) -> float | None:
    return ok[a]["pairs_per_s"] / ok[b]["pairs_per_s"] if a in ok and b in ok else None


def _target(value: float | None, at_least: float) -> dict:
    return {"value": value, "at_least": at_least, "met": None if value is None else value >= at_least}


def show(info: dict, peaks: list[dict], summary: dict, args) -> None:
    params = summary["parameters"]
    print(f"\nmodel: {'tiny' if args.tiny else '1B'} Llama, {params / 1e9:.3f} B parameters ({params:,})")
    print(f"device {args.device}, {precision(args.device)}, activation checkpointing on both sides")
    print(f"pairs per step {args.pairs_per_step}, micro-batch budget {info['budget']} tokens, steps {args.steps}")
    print(f"matmul peak ({peaks[0].get('dtype')}): " + ", ".join(f"{p['peak'] / 1e12:.2f}" for p in peaks) + " TF/s")
    print("\n| method | attention | pairs/s | tokens/s | tokens/micro-batch | MFU useful | MFU hardware | peak MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for m, v in summary["table"].items():
        if "pairs_per_s" not in v:
            print(f"| {m} | {'; '.join(f'{k}: {x}' for k, x in v.items())} |")
            continue
        print(
            f"| {m} | {v['attention']} | {v['pairs_per_s']:.3f} | {v['tokens_per_s']:.0f} | "
            f"{v['tokens_per_microbatch']:.0f} | {v['mfu_useful']:.1%} | {v['mfu_hardware']:.1%} | "
            f"{v['peak_mib']:.0f} ({v['peak_kind']}) |"
        )
    print()
    for k, v in summary["ratios"].items():
        print(f"{k}: {v}")
    print()
    for name, t in summary["targets"].items():
        verdict = (
            "not judged (CPU)"
            if not t["judged"]
            else "not measured"
            if t["met"] is None
            else "met"
            if t["met"]
            else "not met"
        )
        value = "-" if t["value"] is None else f"{t['value']:.3f}"
        print(f"target {name}: {value} -> {verdict}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    parser.add_argument("--tiny", action="store_true", help="a tiny Llama (hidden 64, 2 layers): the CPU smoke run")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per method, warm-up included")
    parser.add_argument("--warmup", type=int, default=1, help="leading steps not timed (compiles land there)")
    parser.add_argument("--pairs", type=int, default=400, help="pairs generated (the length profile)")
    parser.add_argument("--pairs-per-step", type=int, default=16)
    parser.add_argument("--budget", type=int, default=16384, help="ours' max_tokens_per_microbatch (at least)")
    parser.add_argument("--methods", nargs="+", type=str, default=None, help="default: every path (see the doc)")
    parser.add_argument("--trl-sweep", type=int, nargs="+", default=list(TRL_SWEEP), help="TRL's pairs/micro-batch")
    parser.add_argument("--deadline-s", type=float, default=None, help="skip methods that would start past it")
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--work", type=Path, default=None, help="scratch directory (default: a temporary one)")
    parser.add_argument("--json", default=None, help="where to write the JSON result (default: WORK/gpu.json)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.methods = args.methods or default_methods(tuple(args.trl_sweep))
    for method in args.methods:
        if method != "matmul":
            try:
                parse(method)
            except argparse.ArgumentTypeError as error:
                parser.error(str(error))
    args.work = args.work or Path(tempfile.mkdtemp(prefix="dpo-gpu-bench-"))
    args.work.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    if args.child == "matmul":  # the peak needs neither the data nor the model (nor transformers' import)
        harness.emit(child("matmul", args, {}))
        return
    info = run_info(args)
    if args.child:
        harness.emit(child(args.child, args, info))
        return
    print(f"prepared in {time.perf_counter() - started:.0f} s: {info['parameters']:,} parameters", flush=True)
    peaks = [spawn("matmul", args)]
    results = run_methods(args, started)
    peaks.append(spawn("matmul", args))
    peak = max(p.get("peak", 0.0) for p in peaks)
    if not peak:
        raise SystemExit(f"error: the matmul peak was not measured: {peaks[0].get('reason')}")
    summary = summarize(info, results, peak, args)
    show(info, peaks, summary, args)
    doc = {
        "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "nproc": os.cpu_count(),
        "wall_s": time.perf_counter() - started,
        "data": {k: info[k] for k in ("budget", "longest_pair", "redrawn", "profile_train", "padding_full")},
        "matmul": peaks,
        "summary": summary,
        "runs": results,
    }
    target = Path(args.json) if args.json else args.work / "gpu.json"
    target.write_text(json.dumps(doc, indent=1))
    print(f"\nJSON written to {target}")


if __name__ == "__main__":
    main()
