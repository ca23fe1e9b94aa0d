"""One packed micro-batch of vision-language pairs: the text row, its segments' images in row order, its positions."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dpo_data.errors import DataError
from dpo_data.loading.microbatch import CHOSEN, PROMPT, REJECTED, pack_microbatch, pack_shared_prompt
from dpo_train.vision import rope
from dpo_train.vision.families import Family, family_of


@dataclass(frozen=True)
class VisionPair:
    """One pair as the loader delivers it: its token ids (`dpo_data.dataset.store.PairIds`; the prompt's image
    placeholders already expanded as the processor expands them, the completions without images) and its
    prompt's images as the processor outputs them for that prompt alone, one batch row's worth without the
    batch dimension, in placeholder order:

    - Qwen2.5-VL: `pixel_values` float [patches, C * temporal_patch * patch**2], `image_grid_thw` int64 [images, 3];
    - Idefics3: `pixel_values` float [crops, C, H, W], `pixel_attention_mask` [crops, H, W].

    `images` is empty for a prompt without images."""

    ids: Any
    images: dict[str, torch.Tensor]


def pack_vision(
    pairs: list[VisionPair], config: Any, layout: str = "separate", pad_to_multiple_of: int | None = None
) -> dict[str, Any]:
    """The packed micro-batch of `pairs` for a model of `config`: `pack_microbatch` (separate) or
    `pack_shared_prompt` (shared_prompt) of their ids, plus

    - the row's image inputs (`Family.row_images`): the images of every segment that holds them, in row
      order. Separate layout: both of a pair's segments hold its prompt, so its images go twice and the
      vision tower encodes them twice; shared_prompt: the prompt segment alone, once;
    - `segment_images` int32 [S]: how many images (Qwen2.5-VL) or crops (Idefics3) each segment holds;
    - Qwen2.5-VL: `model_position_ids` [4, 1, T] (`rope.row_positions`), what the model's rotary embedding reads.

    Every pair is checked first: its prompt's image placeholders must be as many as its images fill, and
    its completions must hold none (a DataError naming the pair, the counts and the fix)."""
    family = family_of(config)
    for pair in pairs:
        check_pair(pair, family, config)
    pack = pack_shared_prompt if layout == "shared_prompt" else pack_microbatch
    batch = pack([pair.ids for pair in pairs], pad_to_multiple_of)
    owned = [_owned(pairs, slot, role, layout) for slot, role in zip(batch["segment_pair"], batch["segment_role"])]
    batch.update(family.row_images([images for images in owned if images]))
    batch["segment_images"] = torch.tensor([family.images_of(i) if i else 0 for i in owned], dtype=torch.int32)
    if family.rope:
        grids = [images["image_grid_thw"] if images else None for images in owned]
        batch["model_position_ids"] = rope.row_positions(config, batch, grids)
    return batch


def _owned(pairs: list[VisionPair], slot: Any, role: Any, layout: str) -> dict[str, torch.Tensor] | None:
    """The images a segment holds: its pair's prompt images where the segment holds the prompt."""
    holds_prompt = int(role) == PROMPT if layout == "shared_prompt" else int(role) in (CHOSEN, REJECTED)
    return pairs[int(slot)].images or None if holds_prompt else None


def check_pair(pair: VisionPair, family: Family, config: Any) -> None:
    """A DataError unless the pair's prompt holds exactly the placeholders its images fill and its
    completions none, and its images carry the family's inputs."""
    index = pair.ids.index
    missing = [key for key in family.image_keys if pair.images and key not in pair.images]
    if missing:
        raise DataError(
            f"pair {index}: its images lack {', '.join(missing)}; a {family.model_type} prompt's images are the "
            f"processor's {', '.join(family.image_keys)} for that prompt"
        )
    token = config.image_token_id
    video = getattr(config, "video_token_id", None)
    for side in ("chosen", "rejected"):
        if (getattr(pair.ids, side) == token).any():
            raise DataError(
                f"pair {index}: its {side} completion holds image placeholders (token id {token}); images are "
                "supported in the prompt only: move them into the prompt"
            )
    if video is not None and (pair.ids.prompt == video).any():
        raise DataError(
            f"pair {index}: its prompt holds video placeholders (token id {video}); videos are not supported"
        )
    placeholders = int((pair.ids.prompt == token).sum())
    filled = family.image_tokens(config, pair.images) if pair.images else 0
    if placeholders != filled:
        raise DataError(
            f"pair {index}: its prompt holds {placeholders} image placeholders (token id {token}) and its images "
            f"fill {filled}; expand the prompt's image tokens with the model's processor for exactly these images"
        )
