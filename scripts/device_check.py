"""The device check: the trainer on one accelerator, end to end, in a few minutes, with one summary.

Run by scripts/device_check.sh on a CUDA GPU (`--device cuda`, the default); `--device cpu` runs the same
steps on gloo and CPU so that the script itself can be checked where no GPU is. Steps:

1. every collective helper of `dpo_train.parallel.collectives` under a one-rank process group of the device's
   backend (nccl on CUDA; the helpers are forced on, since one rank would otherwise skip them);
2. per-pair log-probs of the demo model in bf16 autocast against fp32, with the attention the trainer
   picks (flash-attention varlen when installed, else sdpa);
3. precompute the reference, train 4 steps in bf16 with a checkpoint every 2; a second run is SIGKILLed
   after step 2 and resumed; `dpo-state diff --values` compares the two bitwise;
4. tokens/s from metrics.jsonl of a run of 10 steps without checkpoints (the median of steps 4 to 10: the
   first ones build the compiled head) and model FLOPs utilization against this device's measured matmul
   peak in the training precision (bf16 on the GPU, fp32 on the CPU);
5. the architecture zoo (tests/architectures/zoo.py) on the device in fp32: every path and layout against
   eager unpacked, per pair, as tests/architectures/test_architectures.py checks on CPU;
6. the chunked vocabulary head compiled on the device (torch.compile, train.compiled_head) against the eager
   chunked head on the CPU, with its speed against the eager head on the device;
7. the MLPs in tiles (train.mlp_tile_tokens) on the device, each layer checkpointed: in fp32 the log-probs and
   gradients of the whole MLPs, as many positions through the MLPs as whole (the layer's recompute stopped at the
   tiles' saved input), and in bf16 autocast the tiles recomputed in bf16 by the backward's own threads;
8. the one-kernel packed paths (issue 56): model.attention flex and varlen on the demo model in bf16 against fp32
   sdpa as in step 2 (varlen refused by name on the CPU), and flex compiled on the device in fp32 on five zoo
   architectures (windows, softcap, chunks with temperature tuning, sinks), both layouts, log-probs and
   gradients against eager unpacked.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
import yaml

from dpo_train.logps.scoring import Scoring

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def check_collectives(device: str) -> dict:
    """Each helper once, under a one-rank group of the device's backend."""
    import torch.distributed as dist

    from dpo_train.parallel import collectives

    backend = {"cuda": "nccl", "npu": "hccl", "cpu": "gloo"}[device]
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    dist.init_process_group(backend, rank=0, world_size=1)
    collectives.active = dist.is_initialized  # one rank: the helpers would skip the collectives
    try:
        where = collectives.device()
        summed = collectives.all_reduce(torch.tensor([1.0, 2.0]))
        most = collectives.all_reduce(torch.tensor([3], dtype=torch.int64), "max")
        collectives.barrier()
        failures = collectives.gather_failures("rank 0: a test failure")
        objects = collectives.gather_objects({"position": 3})
        broadcast = collectives.broadcast_from_rank0(("choice", ""))
        ok = (
            summed.tolist() == [1.0, 2.0]
            and summed.device.type == "cpu"
            and int(most) == 3
            and failures == ["rank 0: a test failure"]
            and objects == [{"position": 3}]
            and broadcast == ("choice", "")
        )
        return {"ok": ok, "backend": backend, "device": str(where)}
    finally:
        dist.destroy_process_group()


def check_logps(model_dir: str, data: str, device: str, requested: str = "auto") -> dict:
    from dpo_data.dataset.store import PairStore
    from dpo_data.loading.microbatch import pack_microbatch
    from dpo_train.attention.choice import attention_for
    from dpo_train.config.sections import ModelConfig
    from dpo_train.logps.pairs import pair_logps
    from dpo_train.model.policy import load_policy, prepare_for_training
    from dpo_train.parallel.device import placement

    place = placement(device, "bf16")
    attention = attention_for(requested, place)
    store = PairStore([data])
    batch = pack_microbatch([store.pair(i) for i in range(16)], pad_to_multiple_of=8)
    batch = {k: v.to(place.device) if torch.is_tensor(v) else v for k, v in batch.items()}
    exact_model = load_policy(ModelConfig(path=model_dir), "sdpa")
    prepare_for_training(exact_model)
    fast_model = load_policy(ModelConfig(path=model_dir), attention)
    prepare_for_training(fast_model)
    with torch.no_grad():
        exact = pair_logps(exact_model.to(place.device), batch, Scoring())
        with place.autocast():
            low = pair_logps(fast_model.to(place.device), batch, Scoring())
    tokens = torch.cat([exact.chosen_tokens, exact.rejected_tokens])
    diff = (torch.cat([low.chosen, low.rejected]) - torch.cat([exact.chosen, exact.rejected])).abs() / tokens
    worst = float(diff.max())
    return {"ok": worst < 0.05, "attention": attention, "max_abs_diff_per_token": worst}


def check_packed_paths(model_dir: str, data: str, device: str) -> dict:
    """flex and varlen: the demo model in bf16 (each against fp32 sdpa, as `check_logps`), or the refusal's first
    line; flex compiled in fp32 on zoo architectures, log-probs and gradients against eager unpacked."""
    from dpo_train.attention.choice import first_line
    from dpo_train.errors import ConfigError

    out: dict = {}
    for path in ("flex", "varlen"):
        try:
            out[path] = check_logps(model_dir, data, device, path)
        except ConfigError as e:
            out[path] = {"refused": first_line(e), "ok": device == "cpu" and path == "varlen"}
    out["flex_zoo_fp32"] = {name: _flex_exact(name, device) for name in FLEX_ZOO}
    out["ok"] = all(r["ok"] for r in (out["flex"], out["varlen"])) and all(
        r["worst"] < 1e-5 for r in out["flex_zoo_fp32"].values()
    )
    return out


FLEX_ZOO = ("llama", "mistral", "gemma2", "llama4_text", "gpt_oss")


def _flex_exact(model_type: str, device: str) -> dict:
    """One zoo architecture on model.attention flex on `device` in fp32: the worst relative error of a pair's
    log-prob and of the gradient of a weighted sum of them, against eager unpacked, over both layouts."""
    from dpo_train.config.sections import ModelConfig
    from dpo_train.logps.pairs import pair_logps
    from dpo_train.logps.probe import eager_unpacked
    from dpo_train.model.load import load_model
    from dpo_train.parallel.device import placement
    from tests.architectures.test_architectures import LAYOUTS
    from tests.architectures.zoo import model_spec, pairs

    spec = ModelConfig(init={"config": model_spec(model_type), "seed": 0})
    model = load_model(spec, "flex", placement(device, "fp32"), None, "separate")[0].to(device).eval()
    weights = torch.linspace(-1.0, 1.0, 2 * len(pairs()), dtype=torch.float64).reshape(-1, 2)

    def scored(logps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        model.zero_grad(set_to_none=True)
        (logps.double().cpu() * weights).sum().backward()
        grads = [p.grad.flatten() for p in model.parameters() if p.grad is not None]
        return logps.detach().double().cpu(), torch.cat(grads).double().cpu()

    truth, truth_grad = scored(eager_unpacked(model, pairs()))
    worst = 0.0
    for build in LAYOUTS.values():
        batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in build(pairs(), 16).items()}
        out = pair_logps(model, batch, Scoring())
        logps, grad = scored(torch.stack([out.chosen, out.rejected], 1))
        worst = max(worst, float(((logps - truth).abs() / truth.abs()).max()))
        worst = max(worst, float((grad - truth_grad).norm() / truth_grad.norm()))
    return {"worst": worst}


def check_architectures(device: str) -> dict:
    """The zoo on this device's kernels (fp32): the worst pair's relative error per architecture, or its refusal."""
    from tests.architectures.test_architectures import TOLERANCE, path_results
    from tests.architectures.zoo import ZOO

    results = {model_type: path_results(model_type, device) for model_type in sorted(ZOO)}
    worst = max((v for r in results.values() for v in r.values() if not isinstance(v, str)), default=0.0)
    return {"ok": worst < TOLERANCE, "worst_relative_error": worst, "results": results}


def check_head(device: str, rows: int = 2048, chunk: int = 512, softcap: float | None = 30.0) -> dict:
    """The chunked vocabulary head compiled on the device (train.compiled_head: true) against the eager chunked head
    on the CPU, fp32, SmolLM2's vocabulary and width with Gemma's softcap (or `softcap`): log-probs, log sum p^2 and
    the gradients of the hidden states and the weight; and seconds per forward and backward on the device, eager and
    compiled (after the compiled one's first, building, call)."""
    from dpo_train.logps import head

    g = torch.Generator().manual_seed(0)
    width, vocab = 576, 49152
    weight, hidden = torch.randn(vocab, width, generator=g) * 0.05, torch.randn(rows, width, generator=g)
    labels, weights = torch.randint(0, vocab, (rows,), generator=g), torch.rand(rows, generator=g) + 0.5

    def run(where: str, mode: bool) -> list[torch.Tensor]:
        w = weight.to(where, copy=True).requires_grad_()  # fresh leaves: no gradient accumulates across runs
        h = hidden.to(where, copy=True).requires_grad_()
        picked, square = head.target_logps(h, head.Head(w, softcap=softcap), labels.to(where), chunk, compiled=mode)
        (picked * weights.to(where)).sum().backward()
        _sync(where)
        return [t.detach().to("cpu", copy=True) for t in (picked, square, h.grad, w.grad)]

    def seconds(mode: bool) -> float:
        run(device, mode)  # warm: the compiled form builds and is checked here
        started = time.perf_counter()
        for _ in range(3):
            run(device, mode)
        return round((time.perf_counter() - started) / 3, 4)

    truth, started = run("cpu", False), time.perf_counter()
    got, first = run(device, True), round(time.perf_counter() - started, 2)  # the build and the check
    names = ("logps", "log_sum_p2", "grad_hidden", "grad_weight")
    errors = {
        n: float((a.double() - b.double()).abs().max() / b.double().abs().max()) for n, a, b in zip(names, got, truth)
    }
    states = {"forward": head.CHUNK_LOGPS.state.get(device), "backward": head.CHUNK_GRAD.state.get(device)}
    why = {**head.CHUNK_LOGPS.why, **head.CHUNK_GRAD.why}
    timing = {"first_compiled_s": first, "eager_s": seconds(False), "compiled_s": seconds(True)}
    ok = all(e <= 1e-4 for e in errors.values()) and set(states.values()) == {"checked"}
    return {"ok": ok, "relative_errors": errors, "compiled": states, "dropped_because": why, **timing}


def check_tiles(model_dir: str, data: str, device: str, tile: int = 64) -> dict:
    """Step 7: SmolLM2's MLPs whole and in tiles of `tile` positions on `device`, each layer checkpointed, on one
    packed micro-batch of 4 pairs: fp32 log-probs and gradients (relative), MLP positions in the forward and
    backward, and in bf16 autocast the dtypes of the first MLP's projection in the backward's recompute."""
    from dpo_data.dataset.store import PairStore
    from dpo_data.loading.microbatch import pack_microbatch
    from dpo_train.config.sections import ModelConfig
    from dpo_train.logps.pairs import pair_logps
    from dpo_train.logps.tiled_mlp import tile_mlps
    from dpo_train.model.policy import load_policy, prepare_for_training

    store = PairStore([data])
    batch = pack_microbatch([store.pair(i) for i in range(4)], pad_to_multiple_of=8)
    batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}

    def run(tiles: int | None, bf16: bool) -> tuple:
        model = load_policy(ModelConfig(path=model_dir), "sdpa")
        prepare_for_training(model, activation_checkpointing=True)
        tile_mlps(model, tiles)
        model.to(device)
        positions, dtypes = [0], []
        mlp = model.model.layers[0].mlp
        mlp.register_forward_pre_hook(lambda module, args: positions.__setitem__(0, positions[0] + args[0].shape[-2]))
        mlp.gate_proj.register_forward_hook(lambda module, args, out: dtypes.append(out.dtype))
        with torch.autocast(torch.device(device).type, dtype=torch.bfloat16, enabled=bf16):
            out = pair_logps(model, batch, Scoring())
        forward = len(dtypes)
        (out.chosen.sum() - 0.5 * out.rejected.sum()).backward()
        logps = torch.cat([out.chosen, out.rejected]).detach().double().cpu()
        grads = torch.cat([p.grad.flatten().double().cpu() for p in model.parameters() if p.grad is not None])
        return logps, grads, positions[0], set(dtypes[forward:])

    (logps, grads, whole_positions, _), (got, got_grads, positions, _) = run(None, False), run(tile, False)
    *_, backward_dtypes = run(tile, True)
    errors = {
        "logps": float(((got - logps).abs() / logps.abs()).max()),
        "gradients": float((got_grads - grads).norm() / grads.norm()),
    }
    ok = max(errors.values()) < 1e-4 and positions == whole_positions and backward_dtypes == {torch.bfloat16}
    return {
        "ok": ok,
        "relative_errors_fp32": errors,
        "mlp_positions_whole_tiled": [whole_positions, positions],
        "bf16_recompute_dtypes": sorted(str(d) for d in backward_dtypes),
    }


def _train(config: Path, *extra: str, env: dict | None = None, check: bool = True) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "dpo_cli.train", str(config), "--quiet", *extra]
    proc = subprocess.run(
        args, capture_output=True, text=True, env={**os.environ, **(env or {})}, start_new_session=True
    )
    if check and proc.returncode:
        raise SystemExit(f"dpo-train failed:\n{proc.stderr[-3000:]}")
    return proc


SPEED_STEPS, SPEED_WARM = 10, 3  # the throughput run's steps, and how many of its first are left out


def check_training(model_dir: str, data: str, work: Path, device: str) -> dict:
    # bf16 and 16 pairs per step on the GPU; fp32 and 4 on the CPU smoke run (bf16 matmuls are slow on
    # CPU, and check_logps covers bf16 there)
    precision, pairs = ("bf16", 16) if device != "cpu" else ("fp32", 4)

    def config(name: str, steps: int = 4, save_every: int = 2) -> Path:
        c = {
            "model": {"path": model_dir, "attention": "auto"},
            "reference": {"mode": "precomputed", "path": str(work / "sidecar")},
            "data": {"path": data, "batching": "pairs", "pairs_per_step": pairs, "max_tokens_per_microbatch": 2048},
            "optim": {"lr": 1.0e-5},
            "train": {
                "output_dir": str(work / name),
                "max_steps": steps,
                "save_every": save_every,
                "precision": precision,
            },
            "distributed": {"device": device},
        }
        path = work / f"{name}.yaml"
        path.write_text(yaml.safe_dump(c))
        return path

    full, cut = config("full"), config("cut")
    _train(full, "--precompute-reference")
    _train(full)
    killed = _train(cut, env={"DPO_TRAIN_KILL": "after-save:2"}, check=False)
    resumed = _train(cut)
    diff = subprocess.run(
        [sys.executable, "-m", "dpo_cli.state", "diff", str(work / "full"), str(work / "cut"), "--values"],
        capture_output=True,
        text=True,
    )
    records = [json.loads(x) for x in (work / "full" / "metrics.jsonl").read_text().splitlines()]
    # tokens/s from a run of its own: no checkpoint saves, and past the first steps, which build the compiled
    # head (train.compiled_head: auto compiles on CUDA; 7-20 s per build on an H200)
    _train(config("speed", steps=SPEED_STEPS, save_every=0))
    speed = [json.loads(x) for x in (work / "speed" / "metrics.jsonl").read_text().splitlines()][SPEED_WARM:]
    return {
        "ok": killed.returncode != 0 and "resumed from" in resumed.stderr and diff.returncode == 0,
        "killed_exit": killed.returncode,
        "bitwise_equal_after_resume": diff.returncode == 0,
        "diff": diff.stdout.strip().splitlines()[-1:],
        "losses": [round(r["loss"], 4) for r in records],
        "tokens_per_s": sorted(r["tokens/s"] for r in speed)[len(speed) // 2],
        "tokens_per_s_steps": [SPEED_WARM + 1, SPEED_STEPS],
    }


def matmul_peak(device: str, dtype: torch.dtype) -> float:
    """This device's measured dense matmul throughput (FLOP/s) in `dtype`: large square matmuls, best of 5."""
    n = 8192 if device == "cuda" else 1024
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    best = 0.0
    for _ in range(5):
        _sync(device)
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        _sync(device)
        best = max(best, 10 * 2 * n**3 / (time.perf_counter() - start))
    return best


def _sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def model_flops_per_token(model_dir: str) -> float:
    """Policy forward and backward (6 N): the reference is precomputed, attention ignored (short pairs)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    return 6.0 * sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", choices=["cuda", "cpu"])
    parser.add_argument(
        "--model", default=None, help="a Hugging Face model directory instead of the bundled SmolLM2-135M-Instruct"
    )
    args = parser.parse_args()
    from dpo_train.run.environment import set_run_environment

    set_run_environment()  # as every run sets it: the model's own code (no hub kernels: offline, they fail to load)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("device check: torch sees no CUDA device; run it on a GPU machine (or --device cpu)")
    from dpo_data.prepare.build import BuildOptions, build
    from dpo_train.model.bundled import materialize_smollm2

    started = time.perf_counter()
    model_dir = args.model or str(materialize_smollm2())
    summary: dict = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu"}
    summary["torch"] = torch.__version__
    summary["model"] = args.model or "SmolLM2-135M-Instruct (bundled)"
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        sample = ROOT / "examples" / "sample"
        inputs = sorted(str(p) for p in sample.iterdir() if p.is_file() and not p.name.endswith(".md"))
        data = str(work / "data")
        build(inputs, model_dir, data, BuildOptions())
        summary["collectives"] = check_collectives(args.device)
        summary["logps_bf16_vs_fp32"] = check_logps(model_dir, data, args.device)
        summary["compiled_head"] = check_head(args.device)
        summary["train_precompute_kill_resume"] = check_training(model_dir, data, work, args.device)
        summary["architectures"] = check_architectures(args.device)
        summary["tiled_mlps"] = check_tiles(model_dir, data, args.device)
        summary["packed_paths"] = check_packed_paths(model_dir, data, args.device)
    peak = matmul_peak(args.device, torch.bfloat16 if args.device == "cuda" else torch.float32)  # as trained
    achieved = summary["train_precompute_kill_resume"]["tokens_per_s"] * model_flops_per_token(model_dir)
    summary["throughput"] = {
        "tokens_per_s": summary["train_precompute_kill_resume"]["tokens_per_s"],
        "matmul_peak_tflops": round(peak / 1e12, 4),
        "model_flops_utilization": round(achieved / peak, 4),
    }
    summary["ok"] = all(part.get("ok", True) for part in summary.values() if isinstance(part, dict))
    summary["seconds"] = round(time.perf_counter() - started, 1)
    print(json.dumps(summary, indent=2))
    sys.exit(0 if summary["ok"] else 1)


if __name__ == "__main__":
    main()
