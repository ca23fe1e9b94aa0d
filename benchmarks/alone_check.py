"""What step 1's alone check costs: each sequence of a micro-batch scored alone through the model as loaded and
compared with the packed numbers, against the reference's packed forward of the same rows (what every step
runs), same rows, same process. Also the rope check and the settings check of the start-up probe.

SmolLM2-135M-Instruct on CPU, fp32, the demo's micro-batches (1024-token budget) of the bundled sample (as
benchmarks/parity_guard.py packs them): for each micro-batch the packed forward (`pair_logps` without autograd)
against `check_alone` with those numbers (which runs `alone_logps`: one forward per sequence, its completion's
logits only); interleaved, `--repeats` passes, the median of each. The check runs at step 1
only: its cost is this ratio times one reference forward of that step.

    .venv/bin/python benchmarks/alone_check.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import harness
from parity_guard import _rows

from dpo_train.logps.scoring import Scoring


def measure(data: str, repeats: int) -> dict:
    import torch

    from dpo_data.dataset.store import PairStore
    from dpo_train.attention import segments
    from dpo_train.config.sections import ModelConfig
    from dpo_train.logps.pairs import pair_logps
    from dpo_train.model.bundled import materialize_smollm2
    from dpo_train.model.policy import load_policy
    from dpo_train.run.alone import check_alone

    torch.manual_seed(0)
    segments.register()
    model = load_policy(ModelConfig(path=str(materialize_smollm2())), segments.ATTENTION).eval()
    batches = _rows(PairStore([data]))
    facts = {"arch": "LlamaForCausalLM", "attention": "segments", "layout": "separate", "rank": 0}
    facts.update(precision="fp32", where="step 1")
    packed, alone = [], []
    with torch.no_grad():
        for _ in range(repeats):
            started = time.perf_counter()
            outs = [pair_logps(model, batch, Scoring()) for batch in batches]
            packed.append(time.perf_counter() - started)
            started = time.perf_counter()
            for batch, out in zip(batches, outs, strict=True):
                check_alone(model, (out.chosen, out.rejected), batch, facts, False, Scoring())
            alone.append(time.perf_counter() - started)
    return {
        "microbatches": len(batches),
        "sequences": sum(2 * int(b["num_pairs"]) for b in batches),
        "tokens": sum(int(b["input_ids"].shape[1]) for b in batches),
        "packed_s": statistics.median(packed),
        "alone_s": statistics.median(alone),
        "ratio": statistics.median(a / p for a, p in zip(alone, packed, strict=True)),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        _, data = harness.smollm2_and_sample(Path(tmp))
        result = measure(data, args.repeats)
    print(
        f"{result['microbatches']} micro-batches, {result['sequences']} sequences, {result['tokens']} tokens: "
        f"packed reference forward {result['packed_s']:.3f} s, alone check {result['alone_s']:.3f} s, ratio "
        f"{result['ratio']:.3f}"
    )


if __name__ == "__main__":
    main()
