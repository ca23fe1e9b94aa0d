"""Run `dpo-train` as one torchrun rank and write the process's peak RSS to $RANK_PEAK_OUT/rank-R.json.

RANK_PEAK_PATCH=replicated-reference leaves the frozen live reference unsharded under FSDP2 (every
rank holds a whole copy: the trainer's behaviour before the reference was sharded), for
benchmarks/memory_bench.py to measure side by side.
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import sys
from pathlib import Path


def _write() -> None:
    out = Path(os.environ["RANK_PEAK_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    (out / f"rank-{os.environ.get('RANK', '0')}.json").write_text(json.dumps({"peak_rss_mib": round(peak_kib / 1024)}))


def _replicate_reference() -> None:
    import dpo_train.trainer as trainer

    shard = trainer._shard

    def shard_trainable_only(model, strategy, world):
        frozen = not any(p.requires_grad for p in model.parameters())
        return model if frozen else shard(model, strategy, world)

    trainer._shard = shard_trainable_only


if __name__ == "__main__":
    atexit.register(_write)
    if os.environ.get("RANK_PEAK_PATCH") == "replicated-reference":
        _replicate_reference()
    from dpo_cli.train import main

    main(sys.argv[1:])
