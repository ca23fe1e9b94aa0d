#!/usr/bin/env python
"""Speed and memory of `dpo-data audit` at 10k, 100k and 1M generated pairs.

    python benchmarks/audit.py [--pairs 10000 100000 1000000] [--quick] [--work DIR] [--json FILE]

Each size is a real dataset directory (shards written by the build's `ShardWriter`, a manifest by its
`manifest_document`, the SmolLM2 tokenizer's attestation), generated from token ids directly (tokenizing 1M rows
of text would take the build most of an hour here): prompts of a 24-token system prefix, a lognormal body
(median 100 tokens) and a 6-token generation header; completions lognormal (median 150) with a 2-token end of
turn. Planted: 2 % exact duplicates, 1 % swapped pairs, 2 % near-duplicate prompts (3 tokens changed), 10 % pairs
sharing an earlier prompt. Each audit runs in a fresh process (`harness.call`): its wall time, pairs/s, and peak
anonymous memory (RssAnon sampled every 20 ms: the shards' memory-mapped pages are the page cache's, not the
audit's), per pair. Targets: 1M pairs in under 5 minutes on 2 cores; memory linear in the pairs at a stated
per-pair cost (the hashes, lengths and findings; the MinHash index: 256 bytes per distinct prompt).

`--quick`: 2,000 pairs, no targets judged (the smoke test's mode). Output: a table, then `JSON {...}`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import harness
import numpy as np

PREFIX, HEADER, END = 24, 6, 2
TARGET_SECONDS_1M = 300.0


def generate(out: str, pairs: int, seed: int = 0) -> dict:
    """Write a dataset of `pairs` generated pairs at `out`; returns what was planted."""
    from dpo_data.dataset.manifest import REJECTS_NAME, write_manifest
    from dpo_data.dataset.shards import ShardWriter
    from dpo_data.prepare.build import BuildOptions
    from dpo_data.prepare.tally import manifest_document

    rng = np.random.default_rng(seed)
    out_dir = Path(out)
    out_dir.mkdir(parents=True)
    options = BuildOptions(pairs_per_shard=100_000)
    writer = ShardWriter(out_dir)
    tally = _tally(pairs)
    fixed = rng.integers(1000, 49000, PREFIX + HEADER + END).astype(np.int32)
    planted, kept = {"exact": 0, "swapped": 0, "near": 0, "shared_prompt": 0}, []
    for start in range(0, pairs, 10_000):
        block = _block(rng, start, min(pairs, start + 10_000), fixed, planted, kept)
        writer.add(block, ["generated"] * len(block), start // options.pairs_per_shard)
        tally.lengths.append(block.lengths)
        tally.max_token_id = max(tally.max_token_id, int(block.chosen.max()), int(block.prompt.max()))
    shards = writer.close()
    tally.pairs, tally.sources = pairs, {"generated": 0}
    tally.source_pairs["generated"] = pairs
    (out_dir / REJECTS_NAME).write_bytes(b"")
    manifest = manifest_document(tally, shards, _attestation(), options.recorded(), out_dir)
    write_manifest(out_dir, manifest)
    return planted


def _tally(pairs: int):
    from dpo_data.prepare.tally import Tally

    entry = {
        "path": "generated.jsonl",
        "format": "jsonl",
        "default_source": "generated",
        "bytes": 0,
        "sha256": "sha256:" + "0" * 64,
        "rows_read": pairs,
        "pairs": pairs,
        "rejected": 0,
    }
    return Tally(inputs=[entry], columns=[], forms=[], rows_total=pairs)


def _attestation() -> dict:
    from dpo_data.tokenizer import load_tokenizer
    from dpo_state.attestation import tokenizer_attestation
    from dpo_train.model.bundled import materialize_smollm2

    return tokenizer_attestation(load_tokenizer(materialize_smollm2()))


def _block(rng, lo: int, hi: int, fixed, planted: dict, kept: list):
    """Pairs lo..hi-1: fresh ones, and the planted copies of earlier ones (from `kept`, this run's pairs)."""
    from dpo_data.dataset.shards import PairBlock

    prompts, chosen, rejected = [], [], []
    for _ in range(lo, hi):
        roll = rng.random()
        if kept and roll < 0.15:
            p, c, r = kept[int(rng.integers(len(kept)))]
            if roll < 0.02:
                planted["exact"] += 1
            elif roll < 0.03:
                c, r = r, c
                planted["swapped"] += 1
            elif roll < 0.05:
                p = p.copy()
                p[PREFIX + rng.integers(0, len(p) - PREFIX - HEADER, 3)] = rng.integers(1000, 49000, 3)
                planted["near"] += 1
            else:
                c, r = _completion(rng, fixed), _completion(rng, fixed)
                planted["shared_prompt"] += 1
        else:
            body = rng.integers(1000, 49000, max(1, int(rng.lognormal(np.log(100), 0.5))))
            p = np.concatenate([fixed[:PREFIX], body, fixed[PREFIX : PREFIX + HEADER]]).astype(np.int32)
            c, r = _completion(rng, fixed), _completion(rng, fixed)
            if len(kept) < 50_000:
                kept.append((p, c, r))
        prompts.append(p), chosen.append(c), rejected.append(r)
    lengths = np.array([[len(p), len(c), len(r)] for p, c, r in zip(prompts, chosen, rejected)], np.int32)
    n = hi - lo
    return PairBlock(
        source_id=np.zeros(n, np.int32),
        row_index=np.arange(lo, hi, dtype=np.int64),
        input_index=np.zeros(n, np.int32),
        input_row=np.arange(lo + 1, hi + 1, dtype=np.int64),
        lengths=lengths,
        prompt=np.concatenate(prompts),
        chosen=np.concatenate(chosen),
        rejected=np.concatenate(rejected),
        row_id=[None] * n,
    )


def _completion(rng, fixed) -> np.ndarray:
    body = rng.integers(1000, 49000, max(1, int(rng.lognormal(np.log(150), 0.6))))
    return np.concatenate([body, fixed[PREFIX + HEADER :]]).astype(np.int32)


def measure(directory: str) -> dict:
    """One audit of `directory` in this (fresh) process: seconds, peak anonymous memory, the counts found."""
    from dpo_data.audit import audit

    peak, stop = [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], _rss_anon())
            time.sleep(0.02)

    base = _rss_anon()
    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    started = time.perf_counter()
    doc = audit([directory])
    seconds = time.perf_counter() - started
    stop.set()
    thread.join()
    counts = {k: doc[k] for k in ("pairs", "exact_duplicates", "conflicting_pairs", "near_duplicate_prompts")}
    return {
        "seconds": seconds,
        "anon_peak_mib": peak[0] / 2**20,
        "anon_base_mib": base / 2**20,
        "maxrss_mib": harness.peak_rss_mib(),
        **counts,
    }


def _rss_anon() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, nargs="+", default=[10_000, 100_000, 1_000_000])
    parser.add_argument("--quick", action="store_true", help="2,000 pairs, no targets judged")
    parser.add_argument("--work", default=None, help="where the datasets are generated (default: a temp dir)")
    parser.add_argument("--json", default=None, help="also write the results to this file")
    args = parser.parse_args()
    sizes = [2000] if args.quick else args.pairs
    work = Path(args.work or tempfile.mkdtemp(prefix="audit-bench-"))
    rows = []
    for n in sizes:
        directory = work / f"pairs-{n}"
        started = time.perf_counter()
        planted = harness.call(generate, str(directory), n) if not directory.exists() else None
        generated = time.perf_counter() - started
        result = harness.call(measure, str(directory))
        extra = (result["anon_peak_mib"] - result["anon_base_mib"]) * 2**20
        rows.append(
            {
                "pairs": n,
                "planted": planted,
                "generate_s": generated,
                **result,
                "pairs_per_s": n / result["seconds"],
                "bytes_per_pair": extra / n,
            }
        )
        print(
            f"{n:>9} pairs: {result['seconds']:8.1f} s, {n / result['seconds']:9.0f} pairs/s, anonymous peak "
            f"{result['anon_peak_mib']:7.1f} MiB ({extra / n:6.0f} B/pair over the start), found dup "
            f"{result['exact_duplicates']} conflict {result['conflicting_pairs']} near "
            f"{result['near_duplicate_prompts']}",
            flush=True,
        )
    judged = {}
    for row in rows:
        if row["pairs"] == 1_000_000 and not args.quick:
            judged["1M pairs under 5 minutes"] = row["seconds"] < TARGET_SECONDS_1M
    summary = {"rows": rows, "targets": judged}
    print("targets: " + (", ".join(f"{k}: {'met' if v else 'NOT met'}" for k, v in judged.items()) or "none judged"))
    print("JSON " + json.dumps(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    sys.exit(main())
