#!/usr/bin/env python
"""The chunked vocabulary head eager against compiled (train.compiled_head), seconds per forward and backward.

    python benchmarks/compiled_head.py [--device cpu] [--rows 4096] [--chunks 512 1092] [--no-softcap]

SmolLM2's vocabulary and width (49,152 x 576) with Gemma's softcap (none with `--no-softcap`: SmolLM2's own head),
fp32: `rows` scored positions in chunks of `--chunks` rows each (1,092 is what the default train.logits_budget_mib
of 1024 gives SmolLM2). Each chunk size runs in a fresh interpreter `scripts/device_check.py`'s `check_head`: the
compiled head on `--device` against the eager one on the CPU, then 3 timed forward-and-backward passes of each form
on `--device` after a warm one (the compiled form's first call builds it with inductor and checks it:
`first_compiled_s`).

Output: one line per chunk size, then one line `JSON {...}`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import harness

ROOT = Path(__file__).resolve().parent.parent


def measure(device: str, rows: int, chunk: int, softcap: float | None) -> dict:
    """The device check's head part, in this (fresh) process."""
    sys.path.insert(0, str(ROOT / "scripts"))
    from device_check import check_head

    return check_head(device, rows, chunk, softcap)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--rows", type=int, default=4096)
    parser.add_argument("--chunks", type=int, nargs="+", default=[512, 1092])
    parser.add_argument("--no-softcap", action="store_true", help="a plain head (SmolLM2's), not Gemma's softcap")
    args = parser.parse_args()
    softcap = None if args.no_softcap else 30.0
    results = []
    for chunk in args.chunks:
        got = harness.call(measure, args.device, args.rows, chunk, softcap, env={"TRANSFORMERS_VERBOSITY": "error"})
        got.update(
            chunk=chunk,
            rows=args.rows,
            softcap=softcap,
            eager_over_compiled=round(got["eager_s"] / got["compiled_s"], 2),
        )
        results.append(got)
        worst = max(got["relative_errors"].values())
        print(
            f"chunk {chunk:5d}: eager {got['eager_s']:.3f} s, compiled {got['compiled_s']:.3f} s "
            f"({got['eager_over_compiled']}x), first compiled call {got['first_compiled_s']} s, "
            f"worst relative error {worst:.1e}, {'ok' if got['ok'] else 'NOT OK'}",
            flush=True,
        )
    print("JSON " + json.dumps({"device": args.device, "results": results}))


if __name__ == "__main__":
    main()
