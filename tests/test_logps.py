"""Packed per-pair log-probs equal those of separate unpacked forwards (tiny random Llama, sdpa, CPU)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dpo_data.dataset.store import PairIds
from dpo_data.loading.microbatch import pack_microbatch, pair_sums
from dpo_train.logps import pair_logps


@pytest.fixture(scope="module")
def model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(config).eval()


def random_pairs(n, seed=0):
    rng = np.random.default_rng(seed)
    ids = lambda k: rng.integers(0, 97, size=k).astype(np.int32)
    # Lengths include a one-token prompt and one-token completions.
    shapes = [(1, 1, 3), (7, 4, 1), (12, 9, 6), (3, 2, 2)][:n]
    return [PairIds(i, 0, ids(p), ids(c), ids(r)) for i, (p, c, r) in enumerate(shapes)]


def unpacked_logp(model, prompt, completion) -> float:
    ids = torch.tensor(np.concatenate([prompt, completion]), dtype=torch.long)[None]
    with torch.no_grad():
        logprobs = torch.log_softmax(model(input_ids=ids, use_cache=False).logits[0].float(), -1)
    n = len(prompt)
    return float(sum(logprobs[n - 1 + k, int(t)] for k, t in enumerate(completion)))


def test_packed_pair_logps_equal_separate_forwards(model):
    pairs = random_pairs(4)
    batch = pack_microbatch(pairs, pad_to_multiple_of=16)
    with torch.no_grad():
        out = pair_logps(model, batch)
    expected_c = [unpacked_logp(model, p.prompt, p.chosen) for p in pairs]
    expected_r = [unpacked_logp(model, p.prompt, p.rejected) for p in pairs]
    torch.testing.assert_close(out.chosen, torch.tensor(expected_c), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.rejected, torch.tensor(expected_r), rtol=1e-5, atol=1e-5)
    assert out.chosen_tokens.tolist() == [len(p.chosen) for p in pairs]
    assert out.rejected_tokens.tolist() == [len(p.rejected) for p in pairs]


def test_pair_sums_ignore_padding_and_route_by_role():
    pairs = random_pairs(2)
    batch = pack_microbatch(pairs, pad_to_multiple_of=64)
    ones = torch.ones(batch["input_ids"].shape[1])
    sums = pair_sums(ones, batch)  # tokens per segment, padding excluded
    assert sums.tolist() == [[2.0, 4.0], [11.0, 8.0]]
