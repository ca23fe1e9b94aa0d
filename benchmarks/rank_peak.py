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
import sys
from pathlib import Path

import harness


def _write(training: harness.RssSampler) -> None:
    out = Path(os.environ["RANK_PEAK_OUT"])
    out.mkdir(parents=True, exist_ok=True)
    figures = {"peak_rss_mib": round(harness.peak_rss_mib()), "training_rss_mib": round(training.peak / 2**20)}
    (out / f"rank-{os.environ.get('RANK', '0')}.json").write_text(json.dumps(figures))


def _patch(training: harness.RssSampler) -> None:
    import dpo_train.reference.choice as choice
    import dpo_train.trainer as trainer
    from dpo_train.reference.live import frozen_copy

    step = trainer.Trainer.step

    def measured_step(self):
        record = step(self)
        training.on = self.state.step < self.config.train.max_steps  # from step 1 to the last step's end
        return record

    trainer.Trainer.step = measured_step
    if os.environ.get("RANK_PEAK_PATCH") == "replicated-reference":
        # where the trainer's build_reference calls it
        choice.frozen_reference = lambda policy, strategy, world, tiles: frozen_copy(policy)


if __name__ == "__main__":
    training = harness.RssSampler(0.02)
    atexit.register(_write, training)
    _patch(training)
    from dpo_cli.train import main

    main(sys.argv[1:])
