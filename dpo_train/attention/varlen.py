"""Packed rows through torch's variable-length attention (`varlen_attn`, FlashAttention on CUDA): one kernel call per
layer over all of a row's segments, for the separate layout."""

from __future__ import annotations

from typing import Any

import torch

from dpo_train.attention.features import call_attention
from dpo_train.attention.segments import RowSegments, require_segments
from dpo_train.attention.temperature import by_position, tuned
from dpo_train.errors import ModelError

ATTENTION = "dpo_varlen"
"""The transformers attention implementation name (`model.attention: varlen`)."""
EXPRESSES = frozenset({"sliding window", "temperature tuning"})
"""What the kernel applies: a causal window per segment (its `window_size`), and Llama 4's query scale, applied to
the queries before the call. Chunked attention, logit softcapping and sinks it cannot express."""
PRECISIONS = ("bf16", "fp16")


def unusable(device: str, precision: str, layout: str) -> str | None:
    """Why `model.attention: varlen` cannot run on this placement, or None: a FlashAttention kernel of CUDA in half
    precision, whose segments are independent sequences (a shared prompt's completion sees another segment)."""
    if device != "cuda":
        return f"it is a CUDA kernel (FlashAttention) and distributed.device is {device}"
    if precision not in PRECISIONS:
        return f"FlashAttention runs in {' or '.join(PRECISIONS)} and train.precision is {precision}"
    if layout != "separate":
        return (
            f"data.layout {layout} lets a completion see its prompt's segment, and varlen attention keeps every "
            "segment to itself"
        )
    return None


def cu_seqlens(segments: RowSegments, device: torch.device) -> tuple[torch.Tensor, int]:
    """The row's segment boundaries as the kernel takes them, int32 [N + 1] from 0 to the row's length (row padding
    is a segment of its own), and the longest segment."""
    starts = [start for start, _ in segments.bounds] + [segments.bounds[-1][1]]
    longest = max(stop - start for start, stop in segments.bounds)
    return torch.tensor(starts, dtype=torch.int32, device=device), longest


def varlen_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    dropout: float = 0.0,
    scaling: float | None = None,
    row_segments: RowSegments | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Causal attention within each segment of a packed row in one call: [1, H, T, D] in, [1, T, H, D] out. The
    kernel counts a segment's positions from 0, as `position_ids` do in the separate layout (checked)."""
    from torch.nn.attention.varlen import varlen_attn

    layer, sinks = call_attention(module, "varlen", kwargs)
    _check(module, query, layer, sinks, dropout, row_segments)
    if tuned(module):
        query = by_position(module, query, row_segments.positions(query.device))
    cu, longest = cu_seqlens(row_segments, query.device)
    # transformers' sliding window: a query at p sees keys p - window < q <= p, which is window - 1 to its left
    window = (layer.window - 1, 0) if layer.window is not None else (-1, 0)
    q, k, v = (x[0].transpose(0, 1) for x in (query, key, value))  # [T, H, D]
    out = varlen_attn(
        q, k, v, cu, cu, longest, longest, scale=scaling, window_size=window, enable_gqa=k.shape[1] != q.shape[1]
    )
    return out.unsqueeze(0), None


def _check(module: Any, query: torch.Tensor, layer: Any, sinks: Any, dropout: float, segments: Any) -> None:
    """What the kernel cannot express, refused by name where the model's layers ask for it."""
    name = type(module).__name__
    require_segments(module, segments, "varlen")
    missing = [
        feature
        for feature, present in (
            ("chunked attention", layer.chunk is not None),
            ("attention logit softcapping", layer.softcap is not None),
            ("attention sinks", sinks is not None),
            (f"attention dropout {dropout}", dropout > 0),
        )
        if present
    ]
    if missing:
        raise ModelError(
            f"model.attention varlen cannot express {', '.join(missing)} (layer {getattr(module, 'layer_idx', '?')} "
            f"of {name}); use model.attention auto, segments or flex"
        )
    if query.shape[0] != 1 or any(context >= 0 for context in segments.context):
        raise ModelError("model.attention varlen runs one packed row of the separate layout at a time")
    if any(first != 0 for first in segments.first_position):
        raise ModelError(
            "model.attention varlen counts each segment's positions from 0, and this row's do not start there "
            "(a sequence-parallel shard); use model.attention auto"
        )


def register() -> None:
    """Make ATTENTION a transformers attention implementation (idempotent); like the segment attention it takes
    the row's segments as a keyword argument, so transformers builds no mask for it."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, varlen_attention)
