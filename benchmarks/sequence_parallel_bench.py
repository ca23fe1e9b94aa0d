"""Activation memory and communication per rank for one long pair under sequence parallelism (CPU, gloo).

One pair (prompt 3072, chosen 512, rejected 512 tokens: a 7168-token row) on a tiny random Llama (hidden
64, 4 heads, 4 key/value heads, 2 layers, the SmolLM2 vocabulary of 49152), one policy forward and
backward through `dpo_train.logps.pairs.pair_logps`, as the trainer runs it, for U = 1 (one process, the
ordinary sdpa path), Ulysses U = 2 and 4, and context C = 2 and 4. Per rank:
- saved for backward: the bytes of the distinct tensor storages autograd keeps for the backward pass
  (exact and deterministic: the activation memory);
- peak RSS above the loaded model: sampled every 2 ms during forward and backward, with glibc told to
  map large allocations on their own (MALLOC_MMAP_THRESHOLD_) so RSS follows live tensors;
- bytes handed to collectives during the step (all-to-all, all-gather, reduce-scatter, all-reduce):
  what the split costs in communication; the single-process run has none.

    .venv/bin/python benchmarks/sequence_parallel_bench.py [--prompt 3072 --completion 512] [--meshes 2x1 1x2]
        [--mask-limit N: segments.MASK_LIMIT, 4611686018427387904 for a whole mask however long the row]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import harness

from dpo_train.logps.scoring import Scoring

MODEL = harness.tiny_llama(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4)
MESHES = [(1, 1), (2, 1), (4, 1), (1, 2), (1, 4)]  # (ulysses, context)
COLLECTIVES = ("all_to_all_single", "all_gather_single", "reduce_scatter_single", "all_reduce")


def _count_collectives(traffic: dict) -> None:
    """Wrap torch.distributed's collectives to add up, per call kind, the bytes a rank hands in and the
    bytes it gets back (an all-gather gets C times what it sends; an all-reduce the same it sends)."""
    import torch.distributed as dist

    for name in COLLECTIVES:
        original = getattr(dist, name)

        def counted(*args, _original=original, _name=name, **kwargs):
            sent, got = (args[0], args[0]) if _name == "all_reduce" else (args[1], args[0])
            entry = traffic.setdefault(_name, [0, 0])
            entry[0] += sent.numel() * sent.element_size()
            entry[1] += got.numel() * got.element_size()
            return _original(*args, **kwargs)

        setattr(dist, name, counted)


def _worker(
    rank: int, world: int, port: int, ulysses: int, context: int, lengths: tuple, work: str, mask_limit: int | None
) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist
    from transformers import AutoConfig, AutoModelForCausalLM

    from dpo_data.loading.microbatch import pack_microbatch
    from dpo_train.attention import segments
    from dpo_train.attention.choice import attention_for
    from dpo_train.attention.sequence_parallel import sequence_mesh
    from dpo_train.logps.pairs import pair_logps
    from dpo_train.parallel.device import placement

    torch.set_num_threads(1)  # ranks share the cores; one process gets the same one thread
    if mask_limit is not None:
        segments.MASK_LIMIT = mask_limit
    mesh = None
    if world > 1:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=world)
        mesh = sequence_mesh(rank, world, ulysses, context)
    spec = dict(MODEL)
    config = AutoConfig.for_model(spec.pop("model_type"), **spec)
    config._attn_implementation = attention_for("auto", placement("cpu", "fp32"), mesh)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    rng = np.random.default_rng(0)
    prompt, chosen, rejected = (rng.integers(1, MODEL["vocab_size"], n).astype(np.int32) for n in lengths)
    pair = SimpleNamespace(index=0, source_id=0, prompt=prompt, chosen=chosen, rejected=rejected)
    batch = pack_microbatch([pair], pad_to_multiple_of=8)
    traffic: dict = {}
    _count_collectives(traffic)

    saved: dict = {}

    def pack(tensor):
        storage = tensor.untyped_storage()
        saved[storage.data_ptr()] = storage.nbytes()
        return tensor

    if mesh is not None:
        dist.barrier()
    base = harness.rss_bytes()
    sampler = harness.RssSampler(0.002, on=True)
    started = time.perf_counter()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = pair_logps(model, batch, Scoring(), mesh)
    (out.chosen - out.rejected).sum().backward()
    seconds = time.perf_counter() - started
    peak = sampler.stop()
    figures = {
        "rank": rank,
        "saved_mib": sum(saved.values()) / 2**20,
        "peak_rss_above_model_mib": (peak - base) / 2**20,
        "collective_mib": {k: [v[0] / 2**20, v[1] / 2**20] for k, v in sorted(traffic.items())},
        "seconds": seconds,
        "chosen_logp": float(out.chosen.detach()),
    }
    where = Path(out_path(work, ulysses, context))
    where.mkdir(parents=True, exist_ok=True)
    (where / f"rank-{rank}.json").write_text(json.dumps(figures))
    if mesh is not None:
        dist.barrier()
        dist.destroy_process_group()


def out_path(out: str, ulysses: int, context: int) -> str:
    return os.path.join(out, f"U{ulysses}C{context}")


def main() -> None:
    import torch.multiprocessing as mp

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--prompt", type=int, default=3072)
    parser.add_argument("--completion", type=int, default=512)
    parser.add_argument(
        "--mask-limit", type=int, default=None, help="segments.MASK_LIMIT in every rank (default: its own)"
    )
    parser.add_argument("--meshes", nargs="+", default=None, help="only these U x C, as UxC (1x1 always runs)")
    args = parser.parse_args()
    os.environ["MALLOC_MMAP_THRESHOLD_"] = str(64 * 1024)  # inherited by the spawned ranks
    lengths = (args.prompt, args.completion, args.completion)
    rows = []
    with tempfile.TemporaryDirectory() as work:
        meshes = [m for m in MESHES if m == (1, 1) or args.meshes is None or f"{m[0]}x{m[1]}" in args.meshes]
        for ulysses, context in meshes:
            world = ulysses * context
            mp.start_processes(
                _worker,
                args=(world, harness.free_port(), ulysses, context, lengths, work, args.mask_limit),
                nprocs=world,
                start_method="spawn",
            )
            ranks = [json.loads(p.read_text()) for p in sorted(Path(out_path(work, ulysses, context)).glob("*.json"))]
            rows.append({"ulysses": ulysses, "context": context, "ranks": ranks})
    base = rows[0]["ranks"][0]
    print(f"one pair, prompt {args.prompt}, completions {args.completion}: row of {2 * sum(lengths[:2])} tokens")
    print(
        "| U x C | saved for backward, busiest rank (MiB) | x single | least busy rank "
        "| peak RSS above model, busiest rank (MiB) | x single |"
    )
    print("|---|---|---|---|---|---|")
    for row in rows:
        saved = max(r["saved_mib"] for r in row["ranks"])
        rss = max(r["peak_rss_above_model_mib"] for r in row["ranks"])
        print(
            f"| {row['ulysses']} x {row['context']} | {saved:.1f} | {saved / base['saved_mib']:.3f} "
            f"| {min(r['saved_mib'] for r in row['ranks']):.1f} "
            f"| {rss:.1f} | {rss / base['peak_rss_above_model_mib']:.3f} |"
        )
    print()
    print("| U x C | per rank per step, by call: MiB sent / received | total sent | total received |")
    print("|---|---|---|---|")
    for row in rows:
        traffic = row["ranks"][0]["collective_mib"]
        calls = ", ".join(f"{k} {v[0]:.3f} / {v[1]:.3f}" for k, v in traffic.items()) or "none"
        sent, got = sum(v[0] for v in traffic.values()), sum(v[1] for v in traffic.values())
        print(f"| {row['ulysses']} x {row['context']} | {calls} | {sent:.2f} | {got:.2f} |")
    logps = {f"U{r['ulysses']}C{r['context']}": r["ranks"][0]["chosen_logp"] for r in rows}
    print()
    print("chosen log-prob per mesh (must agree):", json.dumps(logps))


if __name__ == "__main__":
    main()
