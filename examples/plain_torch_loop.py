"""Use dpo_data without dpo_train: feed packed micro-batches into a plain PyTorch DPO loop.

    python examples/plain_torch_loop.py DATASET_DIR [--steps 3]

A tiny random Llama (vocab of the dataset's tokenizer) stands in for a policy; the reference is a
frozen copy. The loss is the step mean over pairs: each micro-batch adds sum(pair losses) / pairs in
the step (the loader says how many: `step_pairs`), so packing never reweights pairs.
"""

from __future__ import annotations

import argparse
import copy

import torch
import torch.nn.functional as F

from dpo_data import IGNORE_INDEX, DPOLoader, LoaderConfig, is_last, pair_sums


def pair_logps(model, batch) -> tuple[torch.Tensor, torch.Tensor]:
    """Summed completion log-probs per pair, (chosen, rejected), from one packed micro-batch."""
    # Packed rows on CPU: position_ids restart per segment and no attention mask, so sdpa keeps
    # segments apart (transformers detects the packing from position_ids).
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], use_cache=False).logits[0]
    labels = batch["labels"][0]  # pre-shifted: position t predicts labels[t]
    mask = labels != IGNORE_INDEX
    token_logps = torch.zeros_like(labels, dtype=logits.dtype)
    token_logps[mask] = torch.log_softmax(logits[mask], -1).gather(-1, labels[mask, None])[:, 0]
    sums = pair_sums(token_logps, batch)  # per segment, routed to (pair, role); padding dropped
    return sums[:, 0], sums[:, 1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("dataset")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    policy = LlamaForCausalLM(config)
    reference = copy.deepcopy(policy).eval().requires_grad_(False)
    optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
    loader = DPOLoader([args.dataset], LoaderConfig(batching="pairs", pairs_per_step=8, max_tokens_per_microbatch=512))
    beta, step_loss, done = 0.1, 0.0, 0
    for batch in loader:
        if batch["num_pairs"]:
            chosen, rejected = pair_logps(policy, batch)
            with torch.no_grad():
                ref_chosen, ref_rejected = pair_logps(reference, batch)
            margins = beta * ((chosen - ref_chosen) - (rejected - ref_rejected))
            loss = -F.logsigmoid(margins).sum() / batch["step_pairs"]  # a share of the step mean
            loss.backward()
            step_loss += loss.item()
        if is_last(batch):  # the step's last micro-batch on this rank
            optimizer.step()
            optimizer.zero_grad()
            print(f"step {done}: loss {step_loss:.4f} over {batch['step_pairs']} pairs")
            step_loss, done = 0.0, done + 1
            if done == args.steps:
                break


if __name__ == "__main__":
    main()
