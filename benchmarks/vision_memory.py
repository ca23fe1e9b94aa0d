#!/usr/bin/env python
"""Peak RSS of `dpo-data build --processor` and `dpo-data verify` on pairs with large images, each in a fresh process.

    python benchmarks/vision_memory.py [--pairs 200] [--mib 2] [--before /path/to/old/checkout:/path/to/its/shim]

Writes `--pairs` noise PNGs of `--mib` MiB each (uncompressed: the bytes are the pixels), one a pair, as JSON lines
naming the files and as one Parquet file holding the bytes (one row group, as `pyarrow.parquet.write_table` writes
it), and builds each with the tiny Qwen2.5-VL processor of tests/vision/tiny_vlm.py (the memory under test is the
images' bytes, not the model's); then verifies the JSON lines' dataset. Each command runs as the CLI runs it
(`dpo_cli.data.main`) in a fresh interpreter that reports its peak RSS (VmHWM) and, for `--num-proc 2`, its
largest worker's (ru_maxrss of its children: forked, so the pages they share with it count). `--before` runs the
same commands on another checkout's code first (its PYTHONPATH entries, e.g. an older commit unpacked with
`git archive` and a directory linking `dpo_cli` and `dpo_schemas` to its `cli` and `schemas`).

Output: a table, then one line `JSON {...}`.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
from pathlib import Path

import harness
import numpy as np
import orjson


def cli_child(argv: list[str]) -> dict:
    """In a fresh process: `dpo-data ARGV` as the console script runs it; its exit status and peak RSS (MiB)."""
    from dpo_cli.data import main

    sys.argv = ["dpo-data", *argv]
    try:
        main()
        code = 0
    except SystemExit as e:
        code = e.code or 0
    workers = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024
    return {"code": code, "peak_mib": _hwm_mib(), "workers_peak_mib": workers}


def _hwm_mib() -> float:
    """This process's peak RSS since its exec (VmHWM). Not ru_maxrss: Linux keeps that across exec, so a child
    started from a large parent (this benchmark holds the Parquet rows) would report the parent's peak."""
    with open("/proc/self/status") as f:
        kib = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kib / 1024


def _images(directory: Path, pairs: int, mib: float) -> list[str]:
    """`pairs` distinct noise PNGs of about `mib` MiB each (stored uncompressed), their names."""
    from PIL import Image

    side = int((mib * (1 << 20) / 3) ** 0.5)
    (directory / "img").mkdir()
    names = []
    for k in range(pairs):
        pixels = np.random.default_rng(k).integers(0, 256, size=(side, side, 3), dtype=np.uint8)
        names.append(f"img/{k}.png")
        Image.fromarray(pixels, "RGB").save(directory / names[-1], compress_level=0)
    return names


def _row(k: int, image) -> dict:
    return {
        "prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": f"Picture {k}?"}]}],
        "chosen": [{"role": "assistant", "content": f"Noise {k}."}],
        "rejected": [{"role": "assistant", "content": f"A cat {k}."}],
        "images": [image],
    }


def _inputs(directory: Path, pairs: int, mib: float) -> dict[str, Path]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = _images(directory, pairs, mib)
    jsonl = directory / "pairs.jsonl"
    jsonl.write_bytes(b"".join(orjson.dumps(_row(k, name)) + b"\n" for k, name in enumerate(names)))
    parquet = directory / "inline.parquet"
    rows = [_row(k, (directory / name).read_bytes()) for k, name in enumerate(names)]
    pq.write_table(pa.Table.from_pylist(rows), parquet)
    return {"jsonl": jsonl, "parquet": parquet}


def _commands(inputs: dict[str, Path], processor: Path, work: Path, tag: str) -> list[tuple[str, list[str]]]:
    out = {name: work / f"{tag}-{name}" for name in ("jsonl", "jsonl-np2", "parquet")}
    build = ["build", "--processor", str(processor), "--overwrite"]
    return [
        ("build, JSON lines naming the files", [*build, str(inputs["jsonl"]), "--out", str(out["jsonl"])]),
        (
            "build --num-proc 2, the same",
            [*build, str(inputs["jsonl"]), "--out", str(out["jsonl-np2"]), "--num-proc", "2"],
        ),
        ("build, Parquet holding the bytes", [*build, str(inputs["parquet"]), "--out", str(out["parquet"])]),
        ("verify, the JSON lines' dataset", ["verify", str(out["jsonl"]), "--processor", str(processor)]),
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pairs", type=int, default=200)
    parser.add_argument("--mib", type=float, default=2.0)
    parser.add_argument("--before", default=None, help="PYTHONPATH of the code to measure first (old checkout)")
    args = parser.parse_args()
    sys.path.insert(0, str(harness.ROOT))
    from tests.vision.tiny_vlm import qwen25vl_dir

    results = []
    with tempfile.TemporaryDirectory(prefix="vision-memory-") as tmp:
        work = Path(tmp)
        processor = qwen25vl_dir(work / "qwen25vl")
        inputs = _inputs(work, args.pairs, args.mib)
        images = sum(p.stat().st_size for p in (work / "img").iterdir())
        versions = ([("before", args.before)] if args.before else []) + [("after", None)]
        for tag, pythonpath in versions:
            for label, argv in _commands(inputs, processor, work, tag):
                found = harness.call(cli_child, argv, pythonpath=pythonpath)
                if found["code"] != 0:
                    raise SystemExit(f"{tag}: dpo-data {' '.join(argv)} exited {found['code']}")
                results.append({"version": tag, "command": label, **found})
    print(f"{args.pairs} pairs of one {args.mib} MiB image: {images / (1 << 20):.0f} MiB of images")
    print(f"{'version':<7} {'command':<36} {'peak RSS MiB':>12} {'largest worker MiB':>19}")
    for r in results:
        workers = f"{r['workers_peak_mib']:.0f}" if "num-proc" in r["command"] else ""
        print(f"{r['version']:<7} {r['command']:<36} {r['peak_mib']:>12.0f} {workers:>19}")
    print("JSON " + json.dumps({"pairs": args.pairs, "mib": args.mib, "image_bytes": images, "results": results}))


if __name__ == "__main__":
    main()
