"""Step 1's parity guard: the policy is the reference then, so both must score the run's own pairs alike."""

from __future__ import annotations

import torch

from dpo_data.loading.microbatch import CHOSEN, PADDING, PROMPT, REJECTED, PackedRow
from dpo_data.loading.vision import reorder_images
from dpo_train.errors import ParityError

TOLERANCE = {"fp32": (2e-6, 1e-4), "bf16": (5e-3, 5e-2)}
"""precision -> (relative, absolute nats) a pair's summed log-prob may differ between the policy's training
forward and the reference's forward of the same pairs packed in another order. Exact paths agree to about
1e-8 relative in fp32 (tests/architectures/test_parity_guard.py; bitwise for SmolLM2-135M on CPU, fp32 and bf16); an
attention dropout of 0.1 moves SmolLM2-135M's pair log-probs by 1e-2 relative, a segment scaled by its
row position a tiny random Llama 4's by 1e-5."""

CAUSES = (
    "dropout still on in the training forward (a probability the model hard-codes in a call), another "
    "train/eval difference (router noise, a layer that behaves differently in training), packed segments "
    "seeing each other, or a layer that depends on a token's place in the row rather than its position_ids"
)


def reordered(batch: PackedRow) -> PackedRow:
    """The same micro-batch with its row's segments in another order: pairs last to first, each pair's
    completions rejected before chosen (a shared prompt stays first, ahead of both), padding last.
    Per-pair results come out in the same slots; a vision row's images and model positions move with their
    segments. A model that packs exactly scores every pair of it as
    of `batch`; one whose segments leak into each other, or that reads a token's index in the row, does
    not: every segment but at most one moves, and sees other neighbours."""
    order = _segment_order(batch)
    lengths = batch["segment_length"].long()
    starts = batch["cu_seqlens"].long()[:-1]
    tokens = torch.cat([torch.arange(int(starts[s]), int(starts[s] + lengths[s])) for s in order.tolist()])
    out = dict(batch)
    for key in ("input_ids", "position_ids", "labels"):
        out[key] = batch[key][:, tokens.to(batch[key].device)]
    for key in ("segment_pair", "segment_role", "segment_length", "segment_first_label"):
        if key in batch:
            out[key] = batch[key][order.to(batch[key].device)]
    out.update(reorder_images(batch, order, tokens))  # a vision row's images follow their segments
    cu = torch.zeros_like(batch["cu_seqlens"])
    cu[1:] = torch.cumsum(out["segment_length"].to(cu.dtype), 0)
    out["cu_seqlens"] = cu
    if "segment_context" in batch:
        context = batch["segment_context"].long()[order]
        where = torch.empty_like(order)
        where[order] = torch.arange(len(order))
        moved = torch.where(context >= 0, where[context.clamp(min=0)], context)
        out["segment_context"] = moved.to(batch["segment_context"].dtype)
    return out


def _segment_order(batch: PackedRow) -> torch.Tensor:
    """Old segment indices in their new order (see `reordered`)."""
    pair, role = batch["segment_pair"].long().tolist(), batch["segment_role"].long().tolist()
    rank = {PROMPT: 0, REJECTED: 1, CHOSEN: 2}
    real = [s for s in range(len(pair)) if role[s] != PADDING]
    real.sort(key=lambda s: (-pair[s], rank[role[s]]))
    return torch.tensor(real + [s for s in range(len(pair)) if role[s] == PADDING], dtype=torch.long)


def check_parity(policy: tuple, reference: tuple, batch: PackedRow, facts: dict) -> None:
    """Refuse (ParityError, exit 2, before the optimizer steps) a micro-batch of step 1 where a pair's
    policy log-prob (the training forward) and reference log-prob (`reordered`, without autograd) differ
    beyond `TOLERANCE`; each is a (chosen, rejected) pair of [pairs] tensors, as the loss reads them.
    `facts`: arch, precision, rank, attention, layout (named in the message)."""
    relative, absolute = TOLERANCE[facts["precision"]]
    got = torch.stack(list(policy), 1).detach().double().cpu()
    want = torch.stack(list(reference), 1).detach().double().cpu()
    off = (got - want).abs() - (absolute + relative * want.abs())
    if not bool((off > 0).any()) and bool(torch.isfinite(got).all()):
        return
    slot, side = divmod(int(torch.nan_to_num(off, nan=float("inf")).argmax()), 2)
    index = int(batch["pair_index"][slot])
    raise ParityError(
        f"step 1, micro-batch {batch.get('microbatch')} on rank {facts['rank']}: {facts['arch']} (attention "
        f"{facts['attention']}, data.layout {facts['layout']}, {facts['precision']}) scores pair {index}'s "
        f"{('chosen', 'rejected')[side]} completion {float(got[slot, side]):.6f} in the training forward but "
        f"{float(want[slot, side]):.6f} as the reference, although before the first step the policy is the "
        f"reference (beyond {relative:.0e} relative + {absolute:.0e}). Nothing was stepped: the run would "
        f"train on wrong numbers. Likely causes: {CAUSES}. Report the model (docs/train-config.md, "
        '"Step 1\'s parity guard"); model.attention eager or a supported architecture may avoid it'
    )
