"""Which keys each position of a packed row may see, per layer kind: its own segment causally, plus its context."""

from __future__ import annotations

from typing import Any

import torch

from dpo_train.attention.features import ATTENTION_KINDS, FULL_CAUSAL, LayerAttention, kind_attention, layer_kinds
from dpo_train.attention.kernel import positions_visible


def segment_mask(
    batch: dict[str, Any],
    queries: torch.Tensor | None = None,
    extra: int = 0,
    layer: LayerAttention = FULL_CAUSAL,
) -> torch.Tensor:
    """[Q, T + extra] boolean: which key each query position may attend to. A key is visible when it is
    in the query's segment and not after it (causal), or in the segment's context segment (the pair's
    prompt, in the shared-prompt layout), and, for a windowed or chunked `layer`, within the window or
    chunk measured in `position_ids` (the unpacked sequence's positions). `extra` trailing positions form
    one more segment of their own (divisibility padding). `queries` defaults to every position."""
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
    if layer.restricts_keys:
        positions = batch["position_ids"][0].long().to(device)
        positions = torch.cat([positions, torch.arange(extra, device=device)])
        visible &= positions_visible(positions[queries], positions, layer)
    return visible


def model_masks(batch: dict[str, Any], config: Any, additive: torch.dtype | None) -> Any:
    """The `attention_mask` for transformers' own sdpa or eager attention on a packed row: one [1, 1, T, T]
    mask per layer kind, as the dict the models with `layer_types` take (one mask per kind), or one
    mask for a model whose layers are all alike. Boolean for sdpa; 0 / -inf-like in `additive` for
    eager, which adds the mask to the scores (a boolean mask added would mask nothing)."""
    kinds = [kind for kind in dict.fromkeys(layer_kinds(config)) if kind in ATTENTION_KINDS]

    def one(kind: str) -> torch.Tensor:
        visible = segment_mask(batch, layer=kind_attention(config, kind))[None, None]
        if additive is None:
            return visible
        zero = torch.zeros((), dtype=additive, device=visible.device)
        return torch.where(visible, zero, torch.finfo(additive).min)

    masks = {kind: one(kind) for kind in kinds}
    if getattr(config, "layer_types", None):
        return masks
    return next(iter(masks.values()))
