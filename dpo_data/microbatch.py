"""The micro-batch contract: padding-free packed segments, two per pair, with explicit per-segment identity."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

IGNORE_INDEX = -100
CHOSEN, REJECTED, PADDING = 0, 1, -1


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
    ids, labels, positions, lengths, seg_pair, seg_role = [], [], [], [], [], []
    for slot, pair in enumerate(pairs):
        for role, completion in ((CHOSEN, pair.chosen), (REJECTED, pair.rejected)):
            n_prompt, n = len(pair.prompt), len(pair.prompt) + len(completion)
            ids += [pair.prompt, completion]
            label = np.full(n, IGNORE_INDEX, dtype=np.int64)
            label[n_prompt - 1:n - 1] = completion  # position t predicts token t + 1
            labels.append(label)
            positions.append(np.arange(n, dtype=np.int64))
            lengths.append(n)
            seg_pair.append(slot)
            seg_role.append(role)
    num_input = int(sum(lengths))
    padding = 0
    if pad_to_multiple_of:
        padding = -num_input % pad_to_multiple_of
        if num_input == 0:
            padding = pad_to_multiple_of
    if padding:
        ids.append(np.zeros(padding, dtype=np.int32))
        labels.append(np.full(padding, IGNORE_INDEX, dtype=np.int64))
        positions.append(np.arange(padding, dtype=np.int64))
        lengths.append(padding)
        seg_pair.append(-1)
        seg_role.append(PADDING)
    cu = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    label_all = np.concatenate(labels) if labels else np.zeros(0, dtype=np.int64)
    return {
        "input_ids": torch.from_numpy(_cat(ids, np.int64))[None],
        "position_ids": torch.from_numpy(_cat(positions, np.int64))[None],
        "labels": torch.from_numpy(label_all)[None],
        "cu_seqlens": torch.from_numpy(cu),
        "max_seqlen": int(max(lengths, default=0)),
        "segment_pair": torch.tensor(seg_pair, dtype=torch.int32),
        "segment_role": torch.tensor(seg_role, dtype=torch.int8),
        "segment_length": torch.tensor(lengths, dtype=torch.int32),
        "pair_index": torch.tensor([p.index for p in pairs], dtype=torch.int64),
        "pair_source": torch.tensor([p.source_id for p in pairs], dtype=torch.int32),
        "num_pairs": len(pairs),
        "num_input_tokens": num_input,
        "num_supervised_tokens": int((label_all != IGNORE_INDEX).sum()),
        "num_padding_tokens": padding,
    }


def _cat(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


PROMPT = 2


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
    ids, labels, positions, lengths, seg_pair, seg_role, context, first = [], [], [], [], [], [], [], []
    for slot, pair in enumerate(pairs):
        prompt_segment, n_prompt = len(lengths), len(pair.prompt)
        ids.append(pair.prompt)
        labels.append(np.full(n_prompt, IGNORE_INDEX, dtype=np.int64))
        positions.append(np.arange(n_prompt, dtype=np.int64))
        lengths.append(n_prompt)
        seg_pair.append(slot)
        seg_role.append(PROMPT)
        context.append(-1)
        first.append(IGNORE_INDEX)
        for role, completion in ((CHOSEN, pair.chosen), (REJECTED, pair.rejected)):
            n = len(completion)
            ids.append(completion)
            label = np.full(n, IGNORE_INDEX, dtype=np.int64)
            label[:n - 1] = completion[1:]
            labels.append(label)
            positions.append(np.arange(n_prompt, n_prompt + n, dtype=np.int64))
            lengths.append(n)
            seg_pair.append(slot)
            seg_role.append(role)
            context.append(prompt_segment)
            first.append(int(completion[0]))
    num_input = int(sum(lengths))
    padding = (-num_input % pad_to_multiple_of or (pad_to_multiple_of if num_input == 0 else 0)) if pad_to_multiple_of else 0
    if padding:
        ids.append(np.zeros(padding, dtype=np.int32))
        labels.append(np.full(padding, IGNORE_INDEX, dtype=np.int64))
        positions.append(np.arange(padding, dtype=np.int64))
        lengths.append(padding)
        seg_pair.append(-1)
        seg_role.append(PADDING)
        context.append(-1)
        first.append(IGNORE_INDEX)
    cu = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=cu[1:])
    label_all = _cat(labels, np.int64)
    first_t = torch.tensor(first, dtype=torch.int64)
    return {
        "input_ids": torch.from_numpy(_cat(ids, np.int64))[None],
        "position_ids": torch.from_numpy(_cat(positions, np.int64))[None],
        "labels": torch.from_numpy(label_all)[None],
        "cu_seqlens": torch.from_numpy(cu),
        "max_seqlen": int(max(lengths, default=0)),
        "segment_pair": torch.tensor(seg_pair, dtype=torch.int32),
        "segment_role": torch.tensor(seg_role, dtype=torch.int8),
        "segment_length": torch.tensor(lengths, dtype=torch.int32),
        "segment_context": torch.tensor(context, dtype=torch.int32),
        "segment_first_label": first_t,
        "pair_index": torch.tensor([p.index for p in pairs], dtype=torch.int64),
        "pair_source": torch.tensor([p.source_id for p in pairs], dtype=torch.int32),
        "num_pairs": len(pairs),
        "num_input_tokens": num_input,
        "num_supervised_tokens": int((label_all != IGNORE_INDEX).sum() + (first_t != IGNORE_INDEX).sum()),
        "num_padding_tokens": padding,
    }
