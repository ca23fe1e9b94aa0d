"""One attention computation that honours every layer feature: sdpa when it can express them, eager math when not."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from dpo_train.attention.features import LayerAttention


def expand_kv(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Grouped-query attention: each key/value head serves a block of query heads; repeat them to match."""
    if key.shape[1] != query.shape[1]:
        key = key.repeat_interleave(query.shape[1] // key.shape[1], dim=1)
        value = value.repeat_interleave(query.shape[1] // value.shape[1], dim=1)
    return key, value


def attend(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    visible: torch.Tensor | None,
    layer: LayerAttention,
    scaling: float | None = None,
    sinks: torch.Tensor | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """softmax(scores) @ value, [B, H, Q, D] x [B, H, K, D] -> [B, H, Q, D]. `visible` is the boolean
    [Q, K] (or additive float) mask, or None for plain causal attention (Q == K), which takes sdpa's
    maskless kernels. Softcapping (before the mask) and sinks (one logit per head that joins the
    softmax and is dropped after it) are not expressible in sdpa, so they take the eager math, as the
    models' own eager attention computes it."""
    if layer.softcap is None and sinks is None:
        if visible is None:
            return F.scaled_dot_product_attention(query, key, value, is_causal=True, dropout_p=dropout, scale=scaling)
        return F.scaled_dot_product_attention(query, key, value, attn_mask=visible, dropout_p=dropout, scale=scaling)
    scale = scaling if scaling is not None else 1.0 / math.sqrt(query.shape[-1])
    scores = torch.matmul(query, key.transpose(-1, -2)) * scale
    if layer.softcap is not None:
        scores = torch.tanh(scores / layer.softcap) * layer.softcap
    if visible is None:
        visible = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if visible.dtype == torch.bool:
        scores = scores.masked_fill(~visible, float("-inf"))
    else:
        scores = scores + visible
    if sinks is not None:
        column = sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(*scores.shape[:-1], 1)
        scores = torch.cat([scores, column], dim=-1)
    probs = torch.softmax(scores.float(), dim=-1).to(value.dtype)
    if sinks is not None:
        probs = probs[..., :-1]
    probs = F.dropout(probs, p=dropout, training=dropout > 0)
    return torch.matmul(probs, value)


def positions_visible(
    query_positions: torch.Tensor, key_positions: torch.Tensor, layer: LayerAttention
) -> torch.Tensor:
    """[Q, K] boolean: key position <= query position, within the layer's window and chunk. Positions
    are those of the unpacked sequence (`position_ids`), so a completion's distance to its prompt's keys
    is the same as when it runs unpacked, whatever lies between them in the row."""
    q, k = query_positions[:, None], key_positions[None, :]
    visible = k <= q
    if layer.window is not None:
        visible &= q - k < layer.window
    if layer.chunk is not None:
        visible &= torch.div(q, layer.chunk, rounding_mode="floor") == torch.div(k, layer.chunk, rounding_mode="floor")
    return visible
