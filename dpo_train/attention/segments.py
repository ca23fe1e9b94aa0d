"""Attention segment by segment in a packed row: no row-by-row mask, no work across segments."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from dpo_train.attention.features import LayerAttention, call_attention
from dpo_train.attention.kernel import attend, expand_kv, positions_visible
from dpo_train.attention.temperature import by_position, tuned
from dpo_train.errors import ModelError

ATTENTION = "dpo_segments"
"""The transformers attention implementation name (`model.attention: segments`, and auto on CPU)."""
BLOCK_ROWS = 1024
"""Query rows per block of a long segment (`RowSegments.long`): a windowed block's mask is at most BLOCK_ROWS x
(BLOCK_ROWS + window) elements, and an eager (soft-capped or sink) block's scores H x BLOCK_ROWS x its keys."""
MASK_LIMIT = 2**24
"""A segment whose [own, context + own] key mask would have more elements than this (16 Mi: 80 MiB of boolean
and float mask, about a 4k segment) is never given that mask: a shared-prompt completion of a plain layer runs
as one causal sequence with its prompt, the prompt's query rows recomputed and dropped (sdpa's maskless
kernels, never more attention work than the separate layout does: `RowSegments.continues`), and a windowed or
chunked layer's mask, and a soft-capped or sink layer's scores, are made a block of query rows at a time
(`RowSegments.long`; the eager blocks recomputed in backward). Memory then grows linearly with the length.
Below it the whole mask is kept for the row: a long prompt with short completions would otherwise recompute
the prompt's attention for each."""


@dataclass(frozen=True)
class RowSegments:
    """Where each segment of a row lies, `(start, stop)`, the position of its first token (positions
    then run on by one), and the segment it also sees (its context: the pair's prompt in the
    shared-prompt layout), -1 for none. Row padding past the last segment is one more segment of its
    own. The masks a windowed or chunked layer needs are made once per row and kept, or for a long segment
    block by block as they are used (`long`)."""

    bounds: tuple[tuple[int, int], ...]
    context: tuple[int, ...]
    first_position: tuple[int, ...]
    _masks: dict = field(default_factory=dict, compare=False, repr=False)

    def visible(self, index: int, layer: LayerAttention, device: torch.device) -> torch.Tensor | None:
        """Segment `index`'s [own, context + own] key mask for `layer`, or None when it is plain causal."""
        (start, stop), context = self.bounds[index], self.context[index]
        if context < 0 and not _restricted(self.first_position[index], stop - start, layer):
            return None  # plain causal: sdpa's maskless kernels
        cache_key = (index, layer.window, layer.chunk, device)
        if cache_key not in self._masks:
            self._masks[cache_key] = positions_visible(*self._positions(index, device), layer)
        return self._masks[cache_key]

    def long(self, index: int, layer: LayerAttention, device: torch.device, eager: bool) -> tuple | None:
        """(segment `index`'s query positions, its key positions: its context's, then its own) when it goes a
        block of BLOCK_ROWS query rows at a time (`_blocked`): its whole mask would pass MASK_LIMIT, and a
        window or chunk hides a key of it (with its context) or the layer takes the eager math (`eager`:
        softcap or sinks, whose scores are as square as a mask). None where it runs whole (`visible`), or
        where the positions do not increase."""
        first, length, own = self._sequence(index)
        if own * length <= MASK_LIMIT or not (eager or _restricted(first, length, layer)):
            return None
        own, keys = self._positions(index, device)
        if not bool((keys[1:] > keys[:-1]).all()):  # once per layer of a long segment: a sync, not a cost
            return None
        return own, keys

    def _positions(self, index: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(the positions of segment `index`'s queries, those of its keys: its context's, then its own)."""
        (start, stop), context = self.bounds[index], self.context[index]
        own = self.first_position[index] + torch.arange(stop - start, device=device)
        if context < 0:
            return own, own
        first, last = self.bounds[context]
        prompt = self.first_position[context] + torch.arange(last - first, device=device)
        return own, torch.cat([prompt, own])

    def continues(self, index: int, layer: LayerAttention) -> bool:
        """Whether segment `index` (a completion with a context) runs as one causal sequence with its context:
        its mask would pass MASK_LIMIT, its positions continue the context's, and neither window nor chunk
        hides a key of that sequence, so causal over [context, own] is exactly its mask."""
        if self.context[index] < 0:
            return False
        first, length, own = self._sequence(index)
        joined = first + length - own == self.first_position[index]
        return own * length > MASK_LIMIT and joined and not _restricted(first, length, layer)

    def _sequence(self, index: int) -> tuple[int, int, int]:
        """(the first position of segment `index`'s sequence, its context's when it has one; that sequence's
        length, context and own; the segment's own length)."""
        (start, stop), context = self.bounds[index], self.context[index]
        if context < 0:
            return self.first_position[index], stop - start, stop - start
        first, last = self.bounds[context]
        return self.first_position[context], last - first + stop - start, stop - start

    def positions(self, device: torch.device) -> torch.Tensor:
        """[T] each token's position in its own sequence (row padding counts from 0)."""
        if "positions" not in self._masks:
            parts = [
                first + torch.arange(stop - start) for (start, stop), first in zip(self.bounds, self.first_position)
            ]
            self._masks["positions"] = torch.cat(parts).to(device) if parts else torch.zeros(0, dtype=torch.long)
        return self._masks["positions"]


def _blocked(q, k, v, own, keys, layer: LayerAttention, scaling, sinks, dropout: float) -> torch.Tensor:
    """A long segment a block of BLOCK_ROWS query rows at a time, each over the keys its rows can see with its
    own mask, so that nothing grows with the square of the segment. Through sdpa a block keeps its mask and
    output for backward; through the eager math (softcap, sinks) it would keep its [H, rows, keys] scores, so
    there each block, mask included, is recomputed in backward (a non-reentrant checkpoint)."""
    recompute = (layer.softcap is not None or sinks is not None) and torch.is_grad_enabled()

    def block(start: int) -> tuple:
        rows, columns = _span(own, keys, layer, start)
        visible = (q[:, :, rows], k[:, :, columns], v[:, :, columns], own[rows], keys[columns])
        return (*visible, layer, scaling, sinks, dropout)

    return in_row_blocks(len(own), block, _block, recompute)


def in_row_blocks(
    rows: int, arguments: Callable[[int], tuple], attend_block: Callable, recompute: bool
) -> torch.Tensor:
    """`attend_block(*arguments(start))` for each block of BLOCK_ROWS query rows from 0 to `rows`, concatenated
    along the query rows; under a non-reentrant checkpoint when `recompute`, so that one block's mask and scores
    live at a time in backward too. The one block loop of a long segment and of a sequence-parallel shard."""
    outputs = []
    for start in range(0, rows, BLOCK_ROWS):
        args = arguments(start)
        outputs.append(checkpoint(attend_block, *args, use_reentrant=False) if recompute else attend_block(*args))
    return torch.cat(outputs, dim=-2)


def _block(q, k, v, own, keys, layer: LayerAttention, scaling, sinks, dropout: float) -> torch.Tensor:
    """One block's attention, its rows' mask over its keys made here (in backward too, under a checkpoint)."""
    return attend(q, k, v, positions_visible(own, keys, layer), layer, scaling, sinks, dropout)


def _span(own: torch.Tensor, keys: torch.Tensor, layer: LayerAttention, start: int) -> tuple[slice, slice]:
    """Query rows [start, start + BLOCK_ROWS) of a segment and the keys they can see: from the earliest the
    window or chunk lets the first row see to the last row's own."""
    rows = slice(start, min(start + BLOCK_ROWS, len(own)))
    first, last = int(own[rows.start]), int(own[rows.stop - 1])
    earliest = first - layer.window + 1 if layer.window is not None else 0
    if layer.chunk is not None:
        earliest = max(earliest, first // layer.chunk * layer.chunk)
    return rows, slice(int(torch.searchsorted(keys, earliest)), int(torch.searchsorted(keys, last, right=True)))


def _restricted(first: int, length: int, layer: LayerAttention) -> bool:
    """Whether the window or chunk hides a key of a segment's own causal past."""
    last = first + length - 1
    return (layer.window is not None and length > layer.window) or (
        layer.chunk is not None and first // layer.chunk != last // layer.chunk
    )


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
    starts = torch.tensor([first for first, _ in bounds], dtype=torch.long)
    first_position = batch["position_ids"][0].cpu()[starts].tolist() if bounds else []
    return RowSegments(tuple(bounds), tuple(context), tuple(first_position))


def require_segments(module: Any, row_segments: RowSegments | None, path: str) -> RowSegments:
    """The row's segments a packed path (`path`: segments, flex, varlen) needs, or its refusal by name: a model
    whose layers do not pass the model's keyword arguments on to their attention never hands them over."""
    if row_segments is None:
        raise ModelError(
            f"{type(module).__name__} was called without the row's segments: its layers do not pass the model's "
            f"keyword arguments on to their attention, so model.attention {path} cannot run this model; use "
            "model.attention auto (whose start-up probe takes a path it checked) or sdpa or eager"
        )
    return row_segments


def segment_attention(
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
    """Attention once per segment: causal over the segment itself, or, for a completion in the
    shared-prompt layout, over its prompt's keys and then its own; each layer's window, chunk, softcap
    and sinks applied on the unpacked sequence's positions (`dpo_train.attention.kernel.attend`). The
    work is the sum of the segments' squares, not the row's square, and nothing of the size of the
    row's square exists, nor of a long segment's (MASK_LIMIT). [B, H, S, D] in, [B, S, H, D] out."""
    require_segments(module, row_segments, "segments")
    layer, sinks = call_attention(module, "segments", kwargs)
    if tuned(module):
        query = by_position(module, query, row_segments.positions(query.device))
    key, value = expand_kv(query, key, value)
    maskless = layer.softcap is None and sinks is None  # else the eager math: square scores, long ones in blocks
    outputs = []
    for index, ((start, stop), context) in enumerate(zip(row_segments.bounds, row_segments.context)):
        q, k, v = query[:, :, start:stop], key[:, :, start:stop], value[:, :, start:stop]
        skip = 0
        if context >= 0:
            first, last = row_segments.bounds[context]
            k = torch.cat([key[:, :, first:last], k], dim=2)
            v = torch.cat([value[:, :, first:last], v], dim=2)
            if maskless and row_segments.continues(index, layer):  # the prompt's query rows ride along, dropped
                q, skip = torch.cat([query[:, :, first:last], q], dim=2), last - first
        if skip:
            out = attend(q, k, v, None, layer, scaling, sinks, dropout)[:, :, skip:]
        elif (long := row_segments.long(index, layer, query.device, not maskless)) is not None:
            out = _blocked(q, k, v, *long, layer, scaling, sinks, dropout)
        else:
            out = attend(q, k, v, row_segments.visible(index, layer, query.device), layer, scaling, sinks, dropout)
        outputs.append(out)
    return torch.cat(outputs, dim=2).transpose(1, 2).contiguous(), None


def register() -> None:
    """Make ATTENTION a transformers attention implementation (idempotent). It has no mask function, so
    transformers builds no mask for it: the row's segments come as a keyword argument."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, segment_attention)
