"""Which keys each position of a packed row may attend to: its own segment causally, plus its context segment."""

from __future__ import annotations

from typing import Any

import torch


def segment_mask(batch: dict[str, Any], queries: torch.Tensor | None = None, extra: int = 0) -> torch.Tensor:
    """[Q, T + extra] boolean: which key each query position may attend to. A key is visible when it is
    in the query's segment and not after it (causal), or in the segment's context segment (the pair's
    prompt, in the shared-prompt layout). `extra` trailing positions form one more segment of their
    own (divisibility padding). `queries` defaults to every position."""
    lengths = batch["segment_length"].long()
    device = batch["input_ids"].device
    count = len(lengths)
    segment = torch.repeat_interleave(torch.arange(count, device=device), lengths.to(device))
    segment = torch.cat([segment, segment.new_full((extra,), count)])
    keys = torch.arange(len(segment), device=device)
    queries = keys if queries is None else queries
    visible = (segment[queries, None] == segment[None, :]) & (keys[None, :] <= queries[:, None])
    if "segment_context" in batch:
        context = torch.cat([batch["segment_context"].long().to(device), torch.tensor([-1], device=device)])
        visible |= context[segment[queries]][:, None] == segment[None, :]
    return visible
