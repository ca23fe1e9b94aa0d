"""The start-up probe: a packed row of synthetic pairs must score as its sequences do unpacked, through eager."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dpo_data.dataset.store import PairIds
from dpo_train.attention import segments
from dpo_train.attention.features import kind_attention, layer_kinds, model_config, text_config
from dpo_train.errors import ConfigError

TOLERANCE = 1e-5
"""Largest relative error of a pair's summed completion log-prob (fp32; the paths agree to about 1e-7)."""


def probe_pairs(model: Any) -> list[PairIds]:
    """Three pairs, one of them one token long each side, whose segments are longer than the smallest
    window or chunk of the model (capped at 48 tokens), so windows cut inside segments and across a
    shared prompt. Token ids are drawn from the model's vocabulary with a fixed seed."""
    config = text_config(model)
    spans = [kind_attention(config, kind) for kind in set(layer_kinds(config))]
    sizes = [s for layer in spans for s in (layer.window, layer.chunk) if s]
    span = min([*sizes, 16])
    long = min(span + 4, 48)
    vocab = model.get_input_embeddings().num_embeddings
    rng = np.random.default_rng(0)
    ids = lambda k: rng.integers(0, vocab, size=k).astype(np.int32)
    shapes = [(long // 2 + 1, long, 3), (1, 1, 1), (3, long // 2, long)]
    return [PairIds(i, 0, ids(p), ids(c), ids(r)) for i, (p, c, r) in enumerate(shapes)]


def eager_unpacked(model: Any, pairs: list[PairIds]) -> torch.Tensor:
    """[pairs, 2] completion log-prob sums, each (prompt + completion) run alone through the model's own
    eager attention with no mask: what packing must reproduce. Where transformers' eager attention is
    known not to be the model (`dpo_train.attention.unpacked.eager_wrong`: Falcon with ALiBi) its sdpa."""
    from dpo_train.attention.unpacked import eager_wrong

    config = model_config(model)
    truth = "sdpa" if eager_wrong(text_config(model)) else "eager"
    saved, config._attn_implementation = config._attn_implementation, truth
    device = next(model.parameters()).device
    try:
        sums = torch.zeros(len(pairs), 2, dtype=torch.float64)
        for i, pair in enumerate(pairs):
            for j, completion in enumerate((pair.chosen, pair.rejected)):
                ids = torch.as_tensor(np.concatenate([pair.prompt, completion]), dtype=torch.long, device=device)
                logits = model(input_ids=ids[None], use_cache=False).logits[0].double()
                n = len(pair.prompt)
                picked = torch.log_softmax(logits[n - 1 : -1], -1).gather(1, ids[n:, None].long())
                sums[i, j] = picked.sum()
        return sums
    finally:
        config._attn_implementation = saved


def probe(model: Any, layout: str) -> float:
    """Refuse (ConfigError, exit 2) a model whose packed per-pair log-probs differ from unpacked eager,
    before step 1; returns the worst relative error. Runs without autograd in eval mode (a router's
    training jitter would differ between the two runs), in fp32 where the model is (on CPU, before it
    moves to its device). Under sequence parallelism or flash-attention (which need their group or
    CUDA) the packed side runs the segment attention: the probe then checks the model's layers, and
    the attention path itself is the zoo test's (tests/test_architectures.py). A model on the unpacked
    path (`dpo_train.attention.unpacked`) is probed on it: the row unpacked into a padded batch."""
    from dpo_data.loading.microbatch import pack_microbatch, pack_shared_prompt
    from dpo_train.attention.unpacked import runs_unpacked
    from dpo_train.logps import pair_logps

    config = model_config(model)
    saved, training = config._attn_implementation, model.training
    path = f"unpacked ({saved})" if runs_unpacked(model) else saved
    if saved not in ("eager", "sdpa", segments.ATTENTION):
        segments.register()
        config._attn_implementation = segments.ATTENTION
    pairs = probe_pairs(model)
    pack = pack_shared_prompt if layout == "shared_prompt" else pack_microbatch
    model.eval()
    try:
        with torch.no_grad():
            batch = pack(pairs, pad_to_multiple_of=8)
            device = next(model.parameters()).device
            batch = {k: v.to(device) if torch.is_tensor(v) else v for k, v in batch.items()}
            out = pair_logps(model, batch)
            truth = eager_unpacked(model, pairs)
    finally:
        config._attn_implementation = saved
        model.train(training)
    got = torch.stack([out.chosen, out.rejected], dim=1).double().cpu()
    error = (got - truth).abs() / truth.abs().clamp(min=1e-6)
    worst = float(error.max())
    if not worst <= TOLERANCE:
        pair, side = divmod(int(error.argmax()), 2)
        raise ConfigError(
            f"{type(model).__name__} under attention {path} with data.layout {layout}: the start-up probe's "
            f"packed row gives pair {pair}'s {('chosen', 'rejected')[side]} log-prob {float(got[pair, side]):.6f}, run "
            f"unpacked through eager {float(truth[pair, side]):.6f} (relative error {worst:.1e} > {TOLERANCE:.0e}): "
            "packing would train on wrong numbers. Use model.attention eager, or a supported architecture "
            "(docs/train-config.md); train.probe_packing: false skips this check at your own risk"
        )
    return worst
