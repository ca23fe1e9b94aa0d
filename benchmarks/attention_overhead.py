"""The attention path's cost on a full-attention model: this checkout against another one, same rows, same run.

SmolLM2-135M-Instruct (Llama) on CPU, fp32: 8 packed rows of 12 pairs of the bundled sample, each through
`dpo_train.logps.pairs.pair_logps` forward and backward with the attention `dpo-train` picks (`auto`), 3 passes,
the median reported. Each (checkout, layout) runs in a fresh process, interleaved `--repeats` times, so a
slower machine hour hits both alike; the ratio this / other is what to read. Made to check that the
per-layer window, chunk, softcap and sink handling of `dpo_train/attention` costs a Llama nothing:

    git worktree add /tmp/before <commit>     # the checkout to compare with
    .venv/bin/python benchmarks/attention_overhead.py --other /tmp/before [--repeats 2]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import harness

from dpo_train.logps.scoring import Scoring


def child(root: str, layout: str, data: str) -> float:
    """Seconds for 8 rows forward and backward (median of 3 passes), with `root`'s dpo_train (the parent puts
    `root` on this process's PYTHONPATH)."""
    import torch

    from dpo_data.dataset.store import PairStore
    from dpo_data.loading.microbatch import pack_microbatch, pack_shared_prompt

    try:  # dpo_train in rooms (issue 34)
        from dpo_train.config.sections import ModelConfig
        from dpo_train.logps.pairs import pair_logps
        from dpo_train.model.bundled import materialize_smollm2
        from dpo_train.model.policy import load_policy, prepare_for_training
    except ModuleNotFoundError:  # before them
        from dpo_train.bundled_model import materialize_smollm2
        from dpo_train.config import ModelConfig
        from dpo_train.logps import pair_logps
        from dpo_train.model import load_policy, prepare_for_training

    if (Path(root) / "dpo_train" / "parallel").is_dir():
        from dpo_train.parallel.device import placement
    else:  # before dpo_train/parallel
        from dpo_train.device import placement
    if (Path(root) / "dpo_train" / "attention").is_dir():
        from dpo_train.attention.choice import attention_for
    else:  # before the attention room
        from dpo_train.device import attention_for

    torch.manual_seed(0)
    store = PairStore([data])
    attention = attention_for("auto", placement("cpu", "fp32"), None, layout)
    model = load_policy(ModelConfig(path=str(materialize_smollm2())), attention)
    prepare_for_training(model)
    pack = pack_microbatch if layout == "separate" else pack_shared_prompt
    rows = [pack([store.pair(i) for i in range(k, k + 12)]) for k in range(0, 96, 12)]
    times = []
    for _ in range(3):
        started = time.perf_counter()
        for batch in rows:
            out = pair_logps(model, batch, Scoring())
            (out.chosen.sum() - out.rejected.sum()).backward()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def _run(root: str, layout: str, data: str) -> float:
    # the child imports `root`'s dpo_train first; the benchmark itself always comes from this checkout
    return harness.call(child, root, layout, data, env={"TRANSFORMERS_VERBOSITY": "error"}, pythonpath=root)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--other", help="the checkout to compare with (a git worktree)")
    parser.add_argument("--repeats", type=int, default=1, help="interleaved fresh processes per checkout")
    parser.add_argument("--layouts", nargs="+", default=["separate", "shared_prompt"])
    args = parser.parse_args()
    if not args.other:
        parser.error("--other CHECKOUT is required")
    with tempfile.TemporaryDirectory(prefix="dpo-attention-bench-") as work:
        data = harness.smollm2_and_sample(Path(work))[1]
        for layout in args.layouts:
            this, other = [], []
            for _ in range(args.repeats):
                other.append(_run(args.other, layout, data))
                this.append(_run(str(harness.ROOT), layout, data))
            ratio = statistics.median(this) / statistics.median(other)
            print(
                f"{layout}: this {[round(t, 2) for t in this]} s, other {[round(t, 2) for t in other]} s, "
                f"this / other {ratio:.3f}"
            )


if __name__ == "__main__":
    main()
