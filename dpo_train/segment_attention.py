"""Attention segment by segment in a packed row: no row-by-row mask, no work across segments."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from dpo_train.errors import ModelError

ATTENTION = "dpo_segments"
"""The transformers attention implementation name (`model.attention: segments`, and auto on CPU)."""


@dataclass(frozen=True)
class RowSegments:
    """Where each segment of a row lies, `(start, stop)`, and the segment it also sees (its context: the
    pair's prompt in the shared-prompt layout), -1 for none. Row padding past the last segment is one more
    segment of its own."""

    bounds: tuple[tuple[int, int], ...]
    context: tuple[int, ...]


def row_segments(batch: dict[str, Any]) -> RowSegments:
    lengths = batch["segment_length"].tolist()
    context = batch["segment_context"].tolist() if "segment_context" in batch else [-1] * len(lengths)
    bounds, start = [], 0
    for length in lengths:
        bounds.append((start, start + length))
        start += length
    total = batch["input_ids"].shape[1]
    if start < total:
        bounds.append((start, total))
        context.append(-1)
    return RowSegments(tuple(bounds), tuple(context))


def segment_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    row_segments: RowSegments | None = None,
    **_: Any,
) -> tuple[torch.Tensor, None]:
    """sdpa once per segment: causal over the segment itself (no mask at all: the fast kernels), or, for a
    completion in the shared-prompt layout, over its prompt's keys and then its own, causal aligned to the
    end. The work is the sum of the segments' squares, not the row's square, and nothing of the size of
    the row's square exists. [B, H, S, D] in, [B, S, H, D] out."""
    if row_segments is None:
        raise ModelError(
            "this model runs the segment attention and was called without the row's segments; call it "
            "through dpo_train.logps.pair_logps, or load it with model.attention sdpa"
        )
    key, value = expand_kv(query, key, value)
    outputs = []
    for (start, stop), context in zip(row_segments.bounds, row_segments.context):
        q, k, v = query[:, :, start:stop], key[:, :, start:stop], value[:, :, start:stop]
        if context < 0:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=dropout, scale=scaling)
        else:
            first, last = row_segments.bounds[context]
            k = torch.cat([key[:, :, first:last], k], dim=2)
            v = torch.cat([value[:, :, first:last], v], dim=2)
            visible = torch.ones(stop - start, k.shape[2], dtype=torch.bool, device=q.device)
            visible = visible.tril(diagonal=last - first)  # every context key, then own keys causally
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=visible, dropout_p=dropout, scale=scaling)
        outputs.append(out)
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def expand_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention: each key/value head serves a block of query heads; repeat them to match."""
    if key.shape[1] != query.shape[1]:
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    return key, value


def register() -> None:
    """Make ATTENTION a transformers attention implementation (idempotent). It has no mask function, so
    transformers builds no mask for it: the row's segments come as a keyword argument."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, segment_attention)
