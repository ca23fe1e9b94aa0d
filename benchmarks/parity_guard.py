"""What step 1's parity guard costs: the reference's forward of a reordered row and the comparison, against
the reference's forward of the row as it is (what every other step runs), same rows, same process.

SmolLM2-135M-Instruct on CPU, fp32, the demo's micro-batches (1024-token budget) of the bundled sample:
for each micro-batch, the reference forward of the row (`pair_logps` without autograd) against
`reordered(row)` + that forward + `check_parity` with the policy's numbers; interleaved, `--repeats`
passes over the micro-batches, the median of each pass reported. The policy's training forward is the
same with or without the guard and is not timed. Also timed: `disable_dropout` over the loaded model.

    .venv/bin/python benchmarks/parity_guard.py [--repeats 5]
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import harness

from dpo_train.logps.scoring import Scoring


def measure(data: str, repeats: int) -> dict:
    import torch

    from dpo_data.dataset.store import PairStore
    from dpo_train.attention import segments
    from dpo_train.config.sections import ModelConfig
    from dpo_train.logps.pairs import pair_logps
    from dpo_train.model.bundled import materialize_smollm2
    from dpo_train.model.policy import disable_dropout, load_policy
    from dpo_train.reference.guard import check_parity, reordered

    torch.manual_seed(0)
    segments.register()
    model = load_policy(ModelConfig(path=str(materialize_smollm2())), segments.ATTENTION).eval()
    started = time.perf_counter()
    disable_dropout(model)
    sweep = time.perf_counter() - started
    batches = _rows(PairStore([data]))
    facts = {"arch": "LlamaForCausalLM", "attention": "segments", "layout": "separate", "rank": 0, "precision": "fp32"}
    plain, guarded = [], []
    with torch.no_grad():
        for _ in range(repeats):
            started = time.perf_counter()
            outs = [pair_logps(model, batch, Scoring()) for batch in batches]
            plain.append(time.perf_counter() - started)
            started = time.perf_counter()
            for batch, policy in zip(batches, outs, strict=True):
                ref = pair_logps(model, reordered(batch), Scoring()).scored
                check_parity(policy.scored, ref, batch, facts)
            guarded.append(time.perf_counter() - started)
    tokens = sum(int(b["input_ids"].shape[1]) for b in batches)
    return {
        "microbatches": len(batches),
        "tokens": tokens,
        "plain_s": statistics.median(plain),
        "guarded_s": statistics.median(guarded),
        "ratio": statistics.median(g / p for g, p in zip(guarded, plain, strict=True)),
        "disable_dropout_s": sweep,
    }


def _rows(store) -> list[dict]:
    """The demo's micro-batches without the loader: consecutive pairs packed up to about 1024 tokens."""
    from dpo_data.loading.microbatch import pack_microbatch

    rows, current, size = [], [], 0
    for i in range(store.num_pairs):
        pair = store.pair(i)
        n = 2 * len(pair.prompt) + len(pair.chosen) + len(pair.rejected)
        if current and size + n > 1024:
            rows.append(pack_microbatch(current, 8))
            current, size = [], 0
        current.append(pair)
        size += n
    return (rows + ([pack_microbatch(current, 8)] if current else []))[:8]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        _, data = harness.smollm2_and_sample(Path(tmp))
        result = measure(data, args.repeats)
    print(
        f"{result['microbatches']} micro-batches, {result['tokens']} tokens: reference forward "
        f"{result['plain_s']:.3f} s, reordered + forward + check {result['guarded_s']:.3f} s, ratio "
        f"{result['ratio']:.3f}; disable_dropout {result['disable_dropout_s'] * 1e3:.1f} ms"
    )


if __name__ == "__main__":
    main()
