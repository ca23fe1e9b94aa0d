"""The micro-batch contract: padding-free packed segments with explicit per-segment identity."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

IGNORE_INDEX = -100
CHOSEN, REJECTED, PROMPT, PADDING = 0, 1, 2, -1


def pack_microbatch(pairs: list, pad_to_multiple_of: int | None = None) -> dict[str, Any]:
    """Pack `pairs` (each with .index, .source_id, .prompt, .chosen, .rejected int32 arrays) into one row.

    Layout, pair by pair: [prompt + chosen][prompt + rejected]. See docs/loader.md for every field:
    - `input_ids`, `position_ids` (restart at 0 in every segment), `labels`: int64 [1, T];
    - `labels[t]` is the token that position t must predict: `input_ids[t + 1]` when that token is a
      completion token of the same segment, else -100. So the last prompt position predicts the first
      completion token, and nothing predicts across a segment boundary;
    - `cu_seqlens` int32 [S + 1] (segment starts, then T), `max_seqlen` (longest segment);
    - per segment: `segment_pair` (the pair's slot, -1 for padding), `segment_role` (0 chosen,
      1 rejected, -1 padding), `segment_length`;
    - per pair: `pair_index` (global), `pair_source`;
    - counts: `num_pairs`, `num_input_tokens` (padding excluded), `num_supervised_tokens`, `num_padding_tokens`.
    Padding appears only with `pad_to_multiple_of`: one explicit segment flagged -1 that is never a pair's.
    """
    row = _Row()
    for slot, pair in enumerate(pairs):
        n_prompt = len(pair.prompt)
        for role, completion in ((CHOSEN, pair.chosen), (REJECTED, pair.rejected)):
            n = n_prompt + len(completion)
            label = np.full(n, IGNORE_INDEX, dtype=np.int64)
            label[n_prompt - 1 : n - 1] = completion  # position t predicts token t + 1
            row.add(np.concatenate([pair.prompt, completion]), label, np.arange(n), slot, role)
    return row.finish(pairs, pad_to_multiple_of, shared=False)


def pack_shared_prompt(pairs: list, pad_to_multiple_of: int | None = None) -> dict[str, Any]:
    """Prompt-sharing layout: per pair three segments, [prompt][chosen][rejected]; the prompt appears once.

    Attention: a token of segment s attends causally within s and to every token of segment
    `segment_context[s]` (the pair's prompt for both completions; -1 = none). Positions continue the
    prompt: chosen and rejected both start at the prompt's length.
    Labels, pre-shifted within each segment: `labels[t]` = the next token of the same completion
    segment, else -100. The first token of each completion is predicted from the last prompt position,
    which both completions share, so it is given per segment instead: `segment_first_label[s]`
    (-100 for prompt and padding segments), predicted by the logits at `cu_seqlens[segment_context[s] + 1] - 1`.
    Roles: 0 chosen, 1 rejected, 2 prompt, -1 padding. Counts as in `pack_microbatch`; input tokens
    count the prompt once.
    """
    row = _Row()
    for slot, pair in enumerate(pairs):
        prompt_segment, n_prompt = row.segments, len(pair.prompt)
        row.add(pair.prompt, np.full(n_prompt, IGNORE_INDEX, dtype=np.int64), np.arange(n_prompt), slot, PROMPT)
        for role, completion in ((CHOSEN, pair.chosen), (REJECTED, pair.rejected)):
            n = len(completion)
            label = np.full(n, IGNORE_INDEX, dtype=np.int64)
            label[: n - 1] = completion[1:]
            row.add(
                completion,
                label,
                np.arange(n_prompt, n_prompt + n),
                slot,
                role,
                context=prompt_segment,
                first_label=int(completion[0]),
            )
    return row.finish(pairs, pad_to_multiple_of, shared=True)


class _Row:
    """Accumulates segments of one packed row and turns them into the micro-batch dict."""

    def __init__(self):
        self.ids, self.labels, self.positions = [], [], []
        self.lengths, self.pair, self.role, self.context, self.first = [], [], [], [], []

    @property
    def segments(self) -> int:
        return len(self.lengths)

    def add(self, ids, labels, positions, pair: int, role: int, context: int = -1, first_label: int = IGNORE_INDEX):
        self.ids.append(ids)
        self.labels.append(labels)
        self.positions.append(positions)
        self.lengths.append(len(labels))
        self.pair.append(pair)
        self.role.append(role)
        self.context.append(context)
        self.first.append(first_label)

    def finish(self, pairs: list, pad_to_multiple_of: int | None, shared: bool) -> dict[str, Any]:
        num_input = int(sum(self.lengths))
        padding = 0
        if pad_to_multiple_of:  # an empty micro-batch still gets one full padded block
            padding = -num_input % pad_to_multiple_of or (pad_to_multiple_of if num_input == 0 else 0)
        if padding:
            self.add(
                np.zeros(padding, dtype=np.int64),
                np.full(padding, IGNORE_INDEX, dtype=np.int64),
                np.arange(padding),
                -1,
                PADDING,
            )
        cu = np.zeros(self.segments + 1, dtype=np.int32)
        np.cumsum(self.lengths, out=cu[1:])
        labels = _cat(self.labels)
        first = torch.tensor(self.first, dtype=torch.int64)
        batch = {
            "input_ids": torch.from_numpy(_cat(self.ids))[None],
            "position_ids": torch.from_numpy(_cat(self.positions))[None],
            "labels": torch.from_numpy(labels)[None],
            "cu_seqlens": torch.from_numpy(cu),
            "max_seqlen": int(max(self.lengths, default=0)),
            "segment_pair": torch.tensor(self.pair, dtype=torch.int32),
            "segment_role": torch.tensor(self.role, dtype=torch.int8),
            "segment_length": torch.tensor(self.lengths, dtype=torch.int32),
            "pair_index": torch.tensor([p.index for p in pairs], dtype=torch.int64),
            "pair_source": torch.tensor([p.source_id for p in pairs], dtype=torch.int32),
            "num_pairs": len(pairs),
            "num_input_tokens": num_input,
            "num_supervised_tokens": int((labels != IGNORE_INDEX).sum() + (first != IGNORE_INDEX).sum()),
            "num_padding_tokens": padding,
        }
        if shared:
            batch["segment_context"] = torch.tensor(self.context, dtype=torch.int32)
            batch["segment_first_label"] = first
        return batch


def _cat(parts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(parts).astype(np.int64, copy=False) if parts else np.zeros(0, dtype=np.int64)


def pair_sums(token_values: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    """Sum a per-token quantity [T] over each segment and route it to its pair: [num_pairs, 2] as
    (chosen, rejected). Padding segments (role -1) and prompt segments (role 2) are dropped.

    Segment identity comes from `segment_length`, `segment_pair` and `segment_role`, never from
    `position_ids`. Differentiable in `token_values`.
    """
    lengths = batch["segment_length"].long()
    segment_of_token = torch.repeat_interleave(torch.arange(len(lengths), device=lengths.device), lengths)
    return segments_to_pairs(segment_sums(token_values, segment_of_token.to(token_values.device), len(lengths)), batch)


def segment_sums(values: torch.Tensor, segment: torch.Tensor, segments: int) -> torch.Tensor:
    """Per-target `values` summed per segment [segments], accumulated in float64 and returned in their dtype.

    A float32 running sum of a long segment's log-probs (-700k nats over 64k tokens) keeps a few nats of
    rounding, and on CUDA `index_add` adds in whatever order its atomics land: the policy's and the
    reference's sums of the same tokens then differed by 3.6 nats at 64k completion tokens (an H200, step 1,
    where they must be equal). Summed in float64, both round to the same float32 value and are the exact sum
    to within float32's own rounding."""
    total = torch.zeros(segments, dtype=torch.float64, device=values.device)
    return total.index_add(0, segment, values.to(torch.float64)).to(values.dtype)


def segments_to_pairs(per_segment: torch.Tensor, batch: dict[str, Any]) -> torch.Tensor:
    """Route one value per segment [S] to its pair: [num_pairs, 2] as (chosen, rejected); padding and
    prompt segments are dropped. Differentiable in `per_segment`."""
    role = batch["segment_role"].long().to(per_segment.device)
    keep = (role == CHOSEN) | (role == REJECTED)
    out = torch.zeros(batch["num_pairs"], 2, dtype=per_segment.dtype, device=per_segment.device)
    pair = batch["segment_pair"].to(per_segment.device)
    return out.index_put((pair[keep].long(), role[keep]), per_segment[keep])
