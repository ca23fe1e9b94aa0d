#!/usr/bin/env python
"""Long segments in the segment attention: the whole [segment, keys] mask (before) against MASK_LIMIT (after).

    python benchmarks/long_segments.py [--lengths 8192 16384] [--cases mistral:separate llama:shared_prompt]

One pair (prompt 256 tokens, chosen and rejected `length` tokens each) through `pair_logps`, forward and
backward, on the zoo's tiny random models (tests/architectures/zoo.py: hidden 64, 2 layers, 4 heads) with
vocabulary 1,000 and Mistral's sliding window set to 1,024; each case in a fresh process, once with
`MASK_LIMIT` out of reach (every segment gets its whole mask, as before) and once at its default (a windowed
layer's mask made per block of query rows; a shared-prompt completion of a plain layer run causal with its
prompt). Peak RSS above the process's before the step, seconds, and the chosen log-prob (equal on both).

Output: one line per case, then one line `JSON {...}`.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import harness

from dpo_train.logps.scoring import Scoring

NEVER = 2**62
"""A MASK_LIMIT no segment reaches: the whole mask, as before it."""


def measure(model_type: str, layout: str, length: int, limit: int | None) -> dict:
    """One forward and backward in this (fresh) process; `limit` None keeps MASK_LIMIT's default."""
    import numpy as np

    sys.path.insert(0, str(harness.ROOT))  # the zoo's configs: tests/architectures/zoo.py

    from dpo_data.dataset.store import PairIds
    from dpo_data.loading.microbatch import pack_microbatch, pack_shared_prompt
    from dpo_train.attention import segments
    from dpo_train.config.sections import ModelConfig
    from dpo_train.logps.pairs import pair_logps
    from dpo_train.model.load import load_model
    from dpo_train.parallel.device import placement
    from tests.architectures.zoo import model_spec

    if limit is not None:
        segments.MASK_LIMIT = limit
    spec = {**model_spec(model_type), "max_position_embeddings": 65536, "sliding_window": 1024, "vocab_size": 1000}
    model = load_model(
        ModelConfig(init={"config": spec, "seed": 0}), "segments", placement("cpu", "fp32"), None, layout
    )[0]
    rng = np.random.default_rng(0)
    ids = lambda k: rng.integers(3, 990, size=k).astype(np.int32)  # noqa: E731
    batch = (pack_microbatch if layout == "separate" else pack_shared_prompt)(
        [PairIds(0, 0, ids(256), ids(length), ids(length))], 16
    )
    before, start = harness.peak_rss_mib(), time.perf_counter()
    out = pair_logps(model, batch, Scoring())
    (out.chosen - out.rejected).sum().backward()
    seconds = time.perf_counter() - start
    return {
        "extra_mib": round(harness.peak_rss_mib() - before),
        "seconds": round(seconds, 2),
        "chosen": float(out.chosen[0]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[8192, 16384])
    parser.add_argument(
        "--cases", nargs="+", default=["mistral:separate", "mistral:shared_prompt", "llama:shared_prompt"]
    )
    args = parser.parse_args()
    results = []
    for length in args.lengths:
        for case in args.cases:
            model_type, layout = case.split(":")
            got = {
                name: harness.call(measure, model_type, layout, length, limit, env={"TRANSFORMERS_VERBOSITY": "error"})
                for name, limit in (("whole mask", NEVER), ("MASK_LIMIT", None))
            }
            results.append({"model": model_type, "layout": layout, "length": length, **got})
            old, new = got["whole mask"], got["MASK_LIMIT"]
            print(
                f"{model_type:8s} {layout:13s} {length:6d}: whole mask {old['extra_mib']} MiB {old['seconds']} s, "
                f"MASK_LIMIT {new['extra_mib']} MiB {new['seconds']} s, chosen equal: {old['chosen'] == new['chosen']}",
                flush=True,
            )
    print("JSON " + json.dumps(results))


if __name__ == "__main__":
    main()
