"""The micro-batch contract: padding-free packed segments with explicit per-segment identity."""

from __future__ import annotations

from typing import TypedDict

import numpy as np
import torch

IGNORE_INDEX = -100
CHOSEN, REJECTED, PROMPT, PADDING = 0, 1, 2, -1


class _Packed(TypedDict):
    """The keys every packed row holds; S segments, P pairs, T tokens."""

    input_ids: torch.Tensor
    """int64 [1, T]: the segments one after the other, no padding unless asked."""
    position_ids: torch.Tensor
    """int64 [1, T]: separate layout: restart at 0 in every segment; shared_prompt: a completion's continue its
    prompt's."""
    labels: torch.Tensor
    """int64 [1, T], pre-shifted: `labels[t]` is the token position t must predict, `input_ids[t + 1]`, when that is
    a completion token of the same segment, else IGNORE_INDEX (-100). The last prompt position predicts the first
    completion token; nothing predicts across segments. Do not shift again."""
    cu_seqlens: torch.Tensor
    """int32 [S + 1]: segment starts, then T (varlen attention's boundaries)."""
    max_seqlen: int
    """The longest segment's length."""
    segment_pair: torch.Tensor
    """int32 [S]: the segment's pair's slot in this micro-batch (0..P-1); -1 for padding."""
    segment_role: torch.Tensor
    """int8 [S]: CHOSEN 0, REJECTED 1, PROMPT 2 (shared_prompt), PADDING -1."""
    segment_length: torch.Tensor
    """int32 [S]: each segment's true length."""
    pair_index: torch.Tensor
    """int64 [P]: each pair's global index (its row in the dataset, or in the mixture's order)."""
    pair_source: torch.Tensor
    """int32 [P]: each pair's source id (names: `PairStore(dirs).sources`)."""
    num_pairs: int
    """P; 0 for an empty micro-batch, which joins its step's collectives and contributes nothing."""
    num_input_tokens: int
    """Input tokens, padding excluded (shared_prompt: a prompt counts once)."""
    num_supervised_tokens: int
    """Completion tokens a position predicts (labels, and shared_prompt's first labels, other than -100)."""
    num_padding_tokens: int
    """The padding segment's tokens (`pad_to_multiple_of` only: one segment of role and pair -1); else 0."""


class PackedRow(_Packed, total=False):
    """One packed row as packing builds it: the keys every row holds, and those only its layout or its images
    add (docs/loader.md)."""

    segment_context: torch.Tensor
    """shared_prompt only, int32 [S]: a token of segment s attends causally within s and to all of segment
    `segment_context[s]` (the pair's prompt for both completions; -1: nothing else)."""
    segment_first_label: torch.Tensor
    """shared_prompt only, int64 [S]: each completion's first token, predicted by the logits at its prompt's last
    position `cu_seqlens[segment_context[s] + 1] - 1` (both completions share it, so it cannot live in `labels`);
    -100 elsewhere."""
    segment_images: torch.Tensor
    """Vision rows only (`dpo_data.loading.vision.pack_vision`), int32 [S]: the images (Qwen2.5-VL) or crops
    (Idefics3) each segment holds."""
    pixel_values: torch.Tensor
    """Vision rows only, float32: Qwen2.5-VL [patches, 3 * temporal_patch * patch**2], Idefics3 [1, crops, C, H, W]:
    every image-holding segment's images in row order (separate: both of a pair's segments hold its prompt's
    images, twice; shared_prompt: its prompt segment, once)."""
    image_grid_thw: torch.Tensor
    """Qwen2.5-VL rows only, int64 [images, 3]: each image's patch grid."""
    pixel_attention_mask: torch.Tensor
    """Idefics3 rows only, bool [1, crops, H, W]: each crop's valid pixels."""
    model_position_ids: torch.Tensor
    """Qwen2.5-VL rows only, int64 [4, 1, T]: the row's 1D positions, then each segment's 3D M-RoPE positions (what
    the model's rotary embedding reads)."""


class MicroBatch(PackedRow):
    """What the loader yields: one packed row of this rank, and where it sits in the run's steps. The one
    definition of a micro-batch's keys (tests/data/test_loader.py checks the loader yields exactly these)."""

    epoch: int
    """The epoch of the data it belongs to, counted from 0."""
    step: int
    """Its step within the epoch, counted from 0."""
    microbatch: int
    """Its number within the step on this rank, counted from 0."""
    microbatches_in_step: int
    """This rank's micro-batches in the step (each rank runs as many as the step's busiest; `is_last`)."""
    step_pairs: int
    """Pairs in the whole step, over all ranks: the step mean's denominator (every rank plans the global step)."""
    step_chosen_tokens: int
    """Chosen completion tokens in the whole step, over all ranks: an NLL term's denominator per token of the step."""


def is_last(batch: MicroBatch) -> bool:
    """Whether `batch` is its step's last micro-batch on this rank: the step ends after it (the gradient syncs on
    it, the optimizer steps after it, and a loader state saved after it resumes at the next step)."""
    return batch["microbatch"] + 1 == batch["microbatches_in_step"]


def pack_microbatch(pairs: list, pad_to_multiple_of: int | None = None) -> PackedRow:
    """Pack `pairs` (each with .index, .source_id, .prompt, .chosen, .rejected int32 arrays) into one row.

    Layout, pair by pair: [prompt + chosen][prompt + rejected]; every key is `PackedRow`'s. Padding appears only
    with `pad_to_multiple_of`: one explicit segment flagged -1 that is never a pair's.
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


def pack_shared_prompt(pairs: list, pad_to_multiple_of: int | None = None) -> PackedRow:
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
    """Accumulates segments of one packed row and turns them into a `PackedRow`."""

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

    def finish(self, pairs: list, pad_to_multiple_of: int | None, shared: bool) -> PackedRow:
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
        batch: PackedRow = {
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


def pair_sums(token_values: torch.Tensor, batch: PackedRow) -> torch.Tensor:
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


def segments_to_pairs(per_segment: torch.Tensor, batch: PackedRow) -> torch.Tensor:
    """Route one value per segment [S] to its pair: [num_pairs, 2] as (chosen, rejected); padding and
    prompt segments are dropped. Differentiable in `per_segment`."""
    role = batch["segment_role"].long().to(per_segment.device)
    keep = (role == CHOSEN) | (role == REJECTED)
    out = torch.zeros(batch["num_pairs"], 2, dtype=per_segment.dtype, device=per_segment.device)
    pair = batch["segment_pair"].to(per_segment.device)
    return out.index_put((pair[keep].long(), role[keep]), per_segment[keep])
