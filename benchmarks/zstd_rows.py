#!/usr/bin/env python
"""Reading long rows from `.jsonl.zst` against the same rows as plain `.jsonl`, and memory on a huge line.

    python benchmarks/zstd_rows.py [--mib 64] [--rows 2 4 8] [--huge-gib 1.5]

For each row count, K rows of M MiB each are written as plain JSON lines and as zstd (one stream), and
`dpo_data.prepare.inputs.iter_rows` reads both to the end with --max-row-bytes above the row size. The
ratio zst / jsonl is the cost of decompression; it should stay flat as K grows (the reader is linear:
issue 22 found 2, 4, 8 rows of 64 MiB taking 55 s, 144 s, > 200 s). Then one line of `--huge-gib`
decompressed (a small file on disk) is read at the default limit in a fresh process: it must come back
as one oversized line, and the process's peak RSS growth is reported.

Output: a table, then one line `JSON {...}`.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import harness
import zstandard

from dpo_data.prepare.inputs import OversizedLine, iter_rows, open_input


def _row(mib: int) -> bytes:
    return b'{"prompt": "Q", "chosen": " ' + b"x" * (mib << 20) + b'", "rejected": " b"}\n'


def _read_all(path: Path, limit: int) -> float:
    start = time.perf_counter()
    for _ in iter_rows(open_input(str(path)), max_row_bytes=limit):
        pass
    return time.perf_counter() - start


def _long_rows(mib: int, counts: list[int], tmp: Path) -> list[dict]:
    out = []
    for k in counts:
        plain, packed = tmp / f"rows{k}.jsonl", tmp / f"rows{k}.jsonl.zst"
        row = _row(mib)
        plain.write_bytes(row * k)
        with open(packed, "wb") as f, zstandard.ZstdCompressor().stream_writer(f) as w:
            for _ in range(k):
                w.write(row)
        limit = (mib + 1) << 20
        jsonl, zst = _read_all(plain, limit), _read_all(packed, limit)
        out.append({"rows": k, "mib": mib, "jsonl_s": jsonl, "zst_s": zst, "ratio": zst / jsonl})
        plain.unlink()
        packed.unlink()
    return out


def huge_child(path: str) -> list[int]:
    """In a fresh process: read the huge line at the default limit; [peak RSS growth in MiB, line bytes]."""
    before = harness.peak_rss_mib()
    items = [item for _, item in iter_rows(open_input(path), max_row_bytes=1 << 20)]
    growth = harness.peak_rss_mib() - before
    assert len(items) == 1 and isinstance(items[0], OversizedLine), items
    return [int(growth), items[0].size]


def _huge_line(gib: float, tmp: Path) -> dict:
    path, block = tmp / "huge.jsonl.zst", b"x" * (8 << 20)
    size = int(gib * (1 << 30))
    with open(path, "wb") as f, zstandard.ZstdCompressor().stream_writer(f) as w:
        w.write(b'{"prompt": "')
        for _ in range(size // len(block)):
            w.write(block)
        w.write(b'"}\n')
    start = time.perf_counter()
    growth_mib, line = harness.call(huge_child, str(path))
    return {
        "gib": gib,
        "file_bytes": path.stat().st_size,
        "line_bytes": line,
        "rss_growth_mib": growth_mib,
        "seconds": time.perf_counter() - start,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=int, default=64)
    p.add_argument("--rows", type=int, nargs="+", default=[2, 4, 8])
    p.add_argument("--huge-gib", type=float, default=1.5)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as d:
        rows = _long_rows(args.mib, args.rows, Path(d))
        huge = _huge_line(args.huge_gib, Path(d))
    print(f"{'rows':>5} {'MiB':>5} {'jsonl s':>8} {'zst s':>8} {'zst/jsonl':>10}")
    for r in rows:
        print(f"{r['rows']:>5} {r['mib']:>5} {r['jsonl_s']:>8.2f} {r['zst_s']:>8.2f} {r['ratio']:>10.2f}")
    print(
        f"one {huge['gib']} GiB line ({huge['file_bytes']} bytes on disk): rejected as oversized, peak RSS grew "
        f"{huge['rss_growth_mib']} MiB, {huge['seconds']:.1f} s"
    )
    print("JSON " + json.dumps({"rows": rows, "huge": huge, "self_rss_kib": round(harness.peak_rss_mib() * 1024)}))


if __name__ == "__main__":
    main()
