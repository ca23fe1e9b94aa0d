#!/usr/bin/env python
"""What `train.mlp_tile_tokens: auto` adds to a checkpointed run's start-up: its count of which MLPs run free in
tiles (`free_mlps`), against the packing probe every run already makes (`probe`), on the same model, interleaved.

SmolLM2-135M-Instruct (the bundled model) on CPU, fp32, loaded as a run loads it with activation checkpointing;
`--repeats` rounds of (probe, count), the medians reported with their ratio.

    .venv/bin/python benchmarks/tile_count.py [--repeats 5]

Output: a line per round, then one line `JSON {...}`.
"""

from __future__ import annotations

import argparse
import statistics
import time

import harness


def measure(repeats: int) -> dict:
    from dpo_train.config.sections import ModelConfig
    from dpo_train.logps.probe import probe
    from dpo_train.logps.tiled_mlp import free_mlps, mlps
    from dpo_train.model.bundled import materialize_smollm2
    from dpo_train.model.load import load_model
    from dpo_train.model.policy import prepare_for_training
    from dpo_train.parallel.device import placement

    spec = ModelConfig(path=str(materialize_smollm2()))
    model = load_model(spec, "auto", placement("cpu", "fp32"), None, "separate")[0]
    prepare_for_training(model, activation_checkpointing=True)
    times: dict[str, list[float]] = {"probe": [], "count": []}
    for round_ in range(repeats):
        for name, check in (("probe", lambda: probe(model, "separate")), ("count", lambda: free_mlps(model))):
            start = time.perf_counter()
            got = check()
            times[name].append(time.perf_counter() - start)
        model.train()  # the probe leaves it in eval mode; a run trains next
        print(f"round {round_ + 1}: probe {times['probe'][-1]:.3f} s, count {times['count'][-1]:.3f} s", flush=True)
    medians = {name: statistics.median(values) for name, values in times.items()}
    return {
        "model": "SmolLM2-135M-Instruct",
        "mlps": len(mlps(model)),
        "free": len(got),
        "probe_s": round(medians["probe"], 4),
        "count_s": round(medians["count"], 4),
        "count_over_probe": round(medians["count"] / medians["probe"], 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    harness.emit(measure(parser.parse_args().repeats))


if __name__ == "__main__":
    main()
