"""Run `dpo-train` as one torchrun rank and write its memory high-water marks to $RANK_PEAK_OUT/rank-R.json.

Two figures per rank: `peak_rss_mib`, the process's lifetime peak RSS (`ru_maxrss`: loading and
sharding included), and `training_rss_mib`, the highest RSS sampled every 20 ms from the end of the
first optimizer step to the end of the last (the steady state: forward, backward, optimizer steps).

RANK_PEAK_PATCH=replicated-reference gives every rank a whole, unsharded copy of the frozen live
reference under FSDP2 (the trainer's behaviour before the reference was sharded), for
benchmarks/memory_bench.py to measure side by side.
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import sys
import threading
import time
from pathlib import Path

_PAGE = os.sysconf("SC_PAGE_SIZE")
_training = {"peak": 0, "on": False}


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * _PAGE


def _sample() -> None:
    while True:
        if _training["on"]:
            _training["peak"] = max(_training["peak"], _rss())
        time.sleep(0.02)


def _write() -> None:
    out = Path(os.environ["RANK_PEAK_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux
    figures = {"peak_rss_mib": round(peak_kib / 1024), "training_rss_mib": round(_training["peak"] / 2**20)}
    (out / f"rank-{os.environ.get('RANK', '0')}.json").write_text(json.dumps(figures))


def _patch() -> None:
    import dpo_train.trainer as trainer
    from dpo_train.model import frozen_copy

    step = trainer.Trainer.step

    def measured_step(self):
        record = step(self)
        _training["on"] = self.state.step < self.config.train.max_steps  # from step 1 to the last step's end
        return record

    trainer.Trainer.step = measured_step
    if os.environ.get("RANK_PEAK_PATCH") == "replicated-reference":
        trainer.frozen_reference = lambda policy, strategy, world: frozen_copy(policy)


if __name__ == "__main__":
    atexit.register(_write)
    threading.Thread(target=_sample, daemon=True).start()
    _patch()
    from dpo_cli.train import main

    main(sys.argv[1:])
