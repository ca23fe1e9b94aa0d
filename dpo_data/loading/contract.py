"""Check a micro-batch against its documented contract: cheap, vectorized, every problem named."""

from __future__ import annotations

from typing import Any

import torch

from dpo_data.loading.microbatch import CHOSEN, IGNORE_INDEX, PADDING, PROMPT, REJECTED

_TOKEN_KEYS = ("input_ids", "position_ids", "labels")
_SEGMENT_KEYS = ("segment_pair", "segment_role", "segment_length")
_REQUIRED = (*_TOKEN_KEYS, "cu_seqlens", *_SEGMENT_KEYS, "pair_index", "pair_source", "num_pairs", "step_pairs")


def contract_problems(batch: dict[str, Any]) -> list[str]:
    """Every way `batch` breaks the micro-batch contract (docs/loader.md); empty when it holds.

    Checked: required keys and shapes; segment lengths positive, adding up to the row and matching
    `cu_seqlens`; roles known; padding never part of a pair and every other segment part of one; exactly
    one chosen and one rejected segment per pair; labels only inside completion segments and never on a
    segment's last token (nothing predicts across a boundary); positions restarting in every segment
    (separate layout); per-pair fields of `num_pairs` entries; `step_pairs` at least `num_pairs`; a vision
    row's images as many as its segments claim (`segment_images`), none on padding, and its model positions
    one per token.
    """
    missing = [k for k in _REQUIRED if k not in batch]
    if missing:
        return [f"missing keys: {', '.join(missing)}"]
    shapes = _shape_problems(batch)
    if shapes:
        return shapes
    problems = []
    lengths = batch["segment_length"].long()
    total = batch["input_ids"].shape[1]
    if bool((lengths <= 0).any()):
        problems.append(f"segment_length holds {int((lengths <= 0).sum())} segment(s) of no token")
    if int(lengths.sum()) != total:
        problems.append(f"segment lengths add up to {int(lengths.sum())} tokens, the row has {total}")
    expected_cu = torch.cat([lengths.new_zeros(1), lengths.cumsum(0)])
    if not torch.equal(batch["cu_seqlens"].long(), expected_cu):
        problems.append("cu_seqlens does not match the segment lengths (starts, then the row's length)")
    problems += _role_problems(batch)
    problems += _image_problems(batch)
    if not problems:  # token-level checks need consistent segments
        problems += _label_problems(batch, lengths)
    return problems


def _shape_problems(batch: dict[str, Any]) -> list[str]:
    problems = []
    tokens = batch["input_ids"].shape
    if len(tokens) != 2 or tokens[0] != 1:
        return [f"input_ids has shape {list(tokens)}; a micro-batch is one packed row, [1, T]"]
    problems += [
        f"{k} has shape {list(batch[k].shape)}, input_ids {list(tokens)}"
        for k in _TOKEN_KEYS[1:]
        if batch[k].shape != tokens
    ]
    segments = batch["segment_length"].shape
    problems += [
        f"{k} has shape {list(batch[k].shape)}, segment_length {list(segments)}"
        for k in _SEGMENT_KEYS
        if batch[k].shape != segments
    ]
    if batch["cu_seqlens"].shape != (segments[0] + 1,):
        problems.append(f"cu_seqlens has {batch['cu_seqlens'].shape[0]} entries for {segments[0]} segments")
    n = batch["num_pairs"]
    problems += [
        f"{k} has {batch[k].shape[0]} entries, num_pairs is {n}"
        for k in ("pair_index", "pair_source")
        if batch[k].shape != (n,)
    ]
    if not isinstance(batch["step_pairs"], int) or batch["step_pairs"] < n:
        problems.append(f"step_pairs is {batch['step_pairs']!r}; it counts the whole step, at least num_pairs {n}")
    return problems


def _role_problems(batch: dict[str, Any]) -> list[str]:
    problems = []
    roles, pairs, n = batch["segment_role"].long(), batch["segment_pair"].long(), batch["num_pairs"]
    known = (CHOSEN, REJECTED, PADDING, PROMPT) if "segment_context" in batch else (CHOSEN, REJECTED, PADDING)
    unknown = ~torch.isin(roles, torch.tensor(known))
    if bool(unknown.any()):
        problems.append(f"segment_role holds {sorted(set(roles[unknown].tolist()))}; known roles are {list(known)}")
    padding = roles == PADDING
    if bool((pairs[padding] != -1).any()):
        problems.append("a padding segment (role -1) is assigned to a pair; padding is never part of a pair")
    if bool(((pairs[~padding] < 0) | (pairs[~padding] >= n)).any()):
        problems.append(f"a non-padding segment has a pair slot outside 0..{n - 1}")
        return problems
    for role, name in ((CHOSEN, "chosen"), (REJECTED, "rejected")):
        counts = torch.bincount(pairs[roles == role], minlength=n) if n else torch.zeros(0, dtype=torch.long)
        wrong = torch.nonzero(counts != 1).flatten().tolist()
        if wrong:
            problems.append(
                f"pair slot(s) {wrong[:5]} have {counts[wrong[0]].item()} {name} segments; each pair has one"
            )
    return problems


def _label_problems(batch: dict[str, Any], lengths: torch.Tensor) -> list[str]:
    problems = []
    roles = torch.repeat_interleave(batch["segment_role"].long(), lengths)
    supervised = batch["labels"][0] != IGNORE_INDEX
    outside = supervised & ~((roles == CHOSEN) | (roles == REJECTED))
    if bool(outside.any()):
        problems.append(f"{int(outside.sum())} label(s) outside completion segments (on prompt or padding)")
    ends = lengths.cumsum(0) - 1
    if bool(supervised[ends].any()):
        problems.append("a segment's last token has a label: nothing may predict across a segment boundary")
    if "segment_context" not in batch:
        starts = ends - lengths + 1
        if bool((batch["position_ids"][0][starts] != 0).any()):
            problems.append("position_ids do not restart at 0 where a segment starts")
    return problems


def _image_problems(batch: dict[str, Any]) -> list[str]:
    """A vision row (`dpo_data.loading.vision`): `segment_images` per segment, the image inputs holding exactly
    the images (Qwen2.5-VL: grids, and patches as the grids count them) or crops (Idefics3) it adds up to."""
    from dpo_data.loading.vision import IMAGE_KEYS, row_family

    family = row_family(batch)
    if family is None:
        stray = sorted(k for k in (*IMAGE_KEYS, "model_position_ids") if k in batch)
        return [f"{', '.join(stray)} without segment_images"] if stray else []
    counts = batch["segment_images"]
    if counts.shape != batch["segment_length"].shape:
        return [f"segment_images has shape {list(counts.shape)}, segment_length {list(batch['segment_length'].shape)}"]
    problems = []
    if bool((counts[batch["segment_role"].long() == PADDING] != 0).any()):
        problems.append("a padding segment holds images")
    total, present = int(counts.sum()), [k for k in family.image_keys if k in batch]
    if total and len(present) < len(family.image_keys):
        problems.append(f"segment_images counts {total} but the row lacks {set(family.image_keys) - set(present)}")
    elif family.rope and total:
        grids = batch["image_grid_thw"]
        if grids.shape[0] != total or batch["pixel_values"].shape[0] != int(grids.prod(-1).sum()):
            problems.append(
                f"the row holds {grids.shape[0]} image grids and {batch['pixel_values'].shape[0]} patches; "
                f"segment_images counts {total} images of {int(grids.prod(-1).sum())} patches"
            )
    elif total and any(batch[k].shape[:2] != (1, total) for k in family.image_keys):
        problems.append(f"the row's crops ({[list(batch[k].shape[:2]) for k in family.image_keys]}) are not {total}")
    positions = batch.get("model_position_ids")
    if positions is not None and positions.shape[-1] != batch["input_ids"].shape[1]:
        problems.append(
            f"model_position_ids covers {positions.shape[-1]} tokens, the row has {batch['input_ids'].shape[1]}"
        )
    return problems
