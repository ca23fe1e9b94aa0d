"""What the unpacked path costs: pairs/s of a hybrid model unpacked, against TRL's padded batch and against packing.

A tiny random model (hidden 256, 4 layers, vocab 4096, fp32, CPU), 4 micro-batches of 8 pairs of random
lengths (prompts 16-128 tokens, completions 8-128), each forward and backward through
`dpo_train.logps.pairs.pair_logps`, 3 passes, the median reported. Cases, each in a fresh process:

- `lfm2 unpacked`: LFM2 (conv, attention, conv, attention) on the unpacked path, as `model.attention: auto` runs it;
- `lfm2 trl-padded`: the same model and rows as TRL 1.16's DPOTrainer forwards them (`concatenated_forward`:
  chosen and rejected of every pair as prompt + completion, right-padded to the longest, the model's own
  attention mask, logits at every position) with the same log-prob sums: the padding TRL pays too, without
  running TRL's trainer (too heavy for this machine; the forward is what it does per micro-batch);
- `llama packed` / `llama unpacked`: a Llama of the same size, packed (segment attention, what auto picks on
  CPU) and unpacked asked for: what the padding costs a model that could pack.

    .venv/bin/python benchmarks/unpacked.py [--repeats 1]
"""

from __future__ import annotations

import argparse
import json
import statistics

import harness

from dpo_train.logps.scoring import Scoring

SIZE = dict(
    vocab_size=4096,
    hidden_size=256,
    intermediate_size=512,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
LAYERS = {"lfm2": dict(layer_types=["conv", "full_attention", "conv", "full_attention"]), "llama": {}}
MICROBATCHES, PAIRS = 4, 8


def rows(seed: int = 0) -> list:
    import numpy as np

    from dpo_data.dataset.store import PairIds

    rng = np.random.default_rng(seed)
    ids = lambda k: rng.integers(3, SIZE["vocab_size"], size=k).astype(np.int32)
    pairs = []
    for i in range(MICROBATCHES * PAIRS):
        p, c, r = int(rng.integers(16, 129)), int(rng.integers(8, 129)), int(rng.integers(8, 129))
        pairs.append(PairIds(i, 0, ids(p), ids(c), ids(r)))
    return [pairs[m * PAIRS : (m + 1) * PAIRS] for m in range(MICROBATCHES)]


def child(model_type: str, case: str) -> dict:
    """Seconds per pass over the micro-batches (median of 3) and the padded share of the forwarded tokens."""
    import torch

    from dpo_data.loading.microbatch import pack_microbatch
    from dpo_train.config.sections import ModelConfig
    from dpo_train.logps.pairs import pair_logps
    from dpo_train.model.load import load_model
    from dpo_train.parallel.device import placement

    torch.manual_seed(0)
    torch.set_num_threads(2)
    spec = ModelConfig(init={"config": {"model_type": model_type, **SIZE, **LAYERS[model_type]}, "seed": 0})
    attention = {"unpacked": "unpacked", "packed": "auto", "trl-padded": "unpacked"}[case]
    model = load_model(spec, attention, placement("cpu", "fp32"), None, "separate")[0].train()
    batches = [pack_microbatch(mb) for mb in rows()]
    micro = rows()

    def trl_padded(pairs) -> torch.Tensor:
        """TRL's concatenated forward: [2B, L] prompt + completion, right-padded, full logits."""
        seqs = [
            torch.as_tensor(list(p.prompt) + list(c), dtype=torch.long) for p in pairs for c in (p.chosen, p.rejected)
        ]
        width = max(len(s) for s in seqs)
        ids = torch.zeros(len(seqs), width, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, s in enumerate(seqs):
            ids[i, : len(s)], mask[i, : len(s)] = s, 1
        logits = model(input_ids=ids, attention_mask=mask, use_cache=False).logits
        logp = torch.log_softmax(logits[:, :-1].float(), -1).gather(2, ids[:, 1:, None])[..., 0]
        starts = [len(p.prompt) for p in pairs for _ in (0, 1)]
        keep = torch.zeros_like(logp, dtype=torch.bool)
        for i, (s, seq) in enumerate(zip(starts, seqs)):
            keep[i, s - 1 : len(seq) - 1] = True
        return (logp * keep).sum()

    def one_pass() -> None:
        for batch, pairs in zip(batches, micro):
            model.zero_grad(set_to_none=True)
            if case == "trl-padded":
                loss = trl_padded(pairs)
            else:
                out = pair_logps(model, batch, Scoring())
                loss = out.chosen.sum() + out.rejected.sum()
            loss.backward()

    one_pass()  # warm-up
    seconds = harness.median_seconds(one_pass, repeat=3)
    real = sum(len(p.prompt) * 2 + len(p.chosen) + len(p.rejected) for mb in micro for p in mb)
    if case == "packed":
        forwarded = sum(len(p.prompt) + len(p.chosen) + len(p.prompt) + len(p.rejected) for mb in micro for p in mb)
    else:
        forwarded = sum(
            2 * len(mb) * max(len(p.prompt) + max(len(p.chosen), len(p.rejected)) for p in mb) for mb in micro
        )
    return {"seconds": seconds, "pairs_per_s": MICROBATCHES * PAIRS / seconds, "padding": 1 - real / forwarded}


CASES = [("lfm2", "unpacked"), ("lfm2", "trl-padded"), ("llama", "packed"), ("llama", "unpacked")]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=1, help="interleaved rounds of every case")
    args = parser.parse_args()
    got: dict = {f"{m} {c}": [] for m, c in CASES}
    for _ in range(args.repeats):
        for model_type, case in CASES:
            got[f"{model_type} {case}"].append(harness.call(child, model_type, case))
    summary = {
        k: {"pairs_per_s": statistics.median(r["pairs_per_s"] for r in v), "padding": v[0]["padding"]}
        for k, v in got.items()
    }
    pps = {k: v["pairs_per_s"] for k, v in summary.items()}
    summary["ratios"] = {
        "lfm2 unpacked / trl-padded": pps["lfm2 unpacked"] / pps["lfm2 trl-padded"],
        "llama unpacked / packed": pps["llama unpacked"] / pps["llama packed"],
        "lfm2 unpacked / llama packed": pps["lfm2 unpacked"] / pps["llama packed"],
    }
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
