"""Vision micro-batches: `VisionPair`, the families whose image inputs a packed row carries, and `pack_vision`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dpo_data.errors import DataError
from dpo_data.loading.microbatch import CHOSEN, PROMPT, REJECTED, PackedRow, pack_microbatch, pack_shared_prompt


@dataclass(frozen=True)
class Family:
    """What one family's processor gives per image and how the model reads it.

    `image_keys`: the processor outputs that carry one prompt's images (the model's keyword arguments);
    `rope`: whether the model's positions are 3D M-RoPE positions computed from the image grids."""

    model_type: str
    image_keys: tuple[str, ...]
    rope: bool

    def image_tokens(self, config: Any, images: dict[str, torch.Tensor]) -> int:
        """How many image-token placeholders `images` fill in the prompt's ids."""
        if self.model_type == "qwen2_5_vl":
            merge = config.vision_config.spatial_merge_size
            return int((images["image_grid_thw"].prod(-1) // merge**2).sum())
        vision = config.vision_config  # idefics3: a fixed count per crop
        per_crop = (vision.image_size // vision.patch_size) ** 2 // config.scale_factor**2
        return int(images["pixel_values"].shape[0]) * per_crop

    def images_of(self, images: dict[str, torch.Tensor]) -> int:
        """How many images (Qwen2.5-VL) or crops (Idefics3) the vision tower encodes for `images`."""
        key = "image_grid_thw" if self.model_type == "qwen2_5_vl" else "pixel_values"
        return int(images[key].shape[0])

    def row_images(self, parts: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The model's image inputs for a row whose segments own `parts`, in row order (none: {})."""
        if not parts:
            return {}
        if self.model_type == "qwen2_5_vl":  # patches of every image, one after another, and their grids
            return {key: torch.cat([p[key] for p in parts]) for key in self.image_keys}
        # idefics3: crops [N, C, H, W], all of the processor's one crop size (its max_image_size), so no padding
        sizes = {tuple(p["pixel_values"].shape[-2:]) for p in parts}
        if len(sizes) > 1:
            raise DataError(
                f"idefics3 crops of different sizes {sorted(sizes)} in one row; every image must be processed by "
                "the same processor (one max_image_size)"
            )
        return {key: torch.cat([p[key] for p in parts])[None] for key in self.image_keys}

    def sequence_inputs(self, ids: torch.Tensor, images: dict[str, torch.Tensor] | None) -> dict[str, Any]:
        """The model's inputs for one sequence run alone, as its processor hands them over (the truth's inputs)."""
        if not images:
            return {}
        if self.model_type == "qwen2_5_vl":
            return {**images}
        return {key: value[None] for key, value in images.items()}

    def split_row(self, batch: dict[str, Any]) -> list[dict[str, torch.Tensor]]:
        """The inverse of `row_images`: each segment's own image inputs in a packed row, in segment order ({} for
        a segment without images), as `batch["segment_images"]` counts them."""
        counts = batch["segment_images"].long().tolist()
        if not sum(counts):
            return [{} for _ in counts]
        if self.model_type == "qwen2_5_vl":
            grids = batch["image_grid_thw"].split(counts)
            pixels = batch["pixel_values"].split([int(g.prod(-1).sum()) for g in grids])
            return [{"pixel_values": p, "image_grid_thw": g} if n else {} for p, g, n in zip(pixels, grids, counts)]
        found = {key: batch[key][0].split(counts) for key in self.image_keys}
        return [{key: found[key][s] for key in self.image_keys} if n else {} for s, n in enumerate(counts)]


FAMILIES = {
    "qwen2_5_vl": Family("qwen2_5_vl", ("pixel_values", "image_grid_thw"), rope=True),
    "idefics3": Family("idefics3", ("pixel_values", "pixel_attention_mask"), rope=False),
}
"""model_type -> family: the families whose packed rows are proved equal to each sequence run alone
(tests/vision/test_packed_vision.py)."""

IMAGE_KEYS = frozenset(key for family in FAMILIES.values() for key in family.image_keys)
"""Every key a vision micro-batch may carry for its images."""


def row_family(batch: dict[str, Any]) -> Family | None:
    """The family whose images a packed row carries, read from its keys; None for a row without images."""
    if "segment_images" not in batch:
        return None
    return FAMILIES["qwen2_5_vl" if "image_grid_thw" in batch else "idefics3"]


def reorder_images(batch: dict[str, Any], order: torch.Tensor, tokens: torch.Tensor) -> dict[str, Any]:
    """A vision row's image inputs, `segment_images` and model positions for its segments put in `order` (old
    segment indices in their new order) and its tokens in `tokens` (old token indices in their new order): what
    goes with a row whose segments were reordered, so that each image still meets its own placeholders."""
    family = row_family(batch)
    if family is None:
        return {}
    parts = family.split_row(batch)
    moved = {key: batch[key] for key in family.image_keys if key in batch}
    moved.update(family.row_images([parts[s] for s in order.tolist() if parts[s]]))
    moved["segment_images"] = batch["segment_images"][order.to(batch["segment_images"].device)]
    if "model_position_ids" in batch:
        moved["model_position_ids"] = batch["model_position_ids"][..., tokens.to(batch["model_position_ids"].device)]
    return moved


def vision_family(config: Any) -> Family:
    """The family of a VLM config, or a DataError naming the model type and the supported ones (the trainer
    refuses other models by name before any data is packed: `dpo_train.vision.families.family_of`)."""
    model_type = getattr(config, "model_type", None)
    if model_type not in FAMILIES:
        raise DataError(
            f"model type {model_type}: the loader cannot pack images for it; supported: {', '.join(sorted(FAMILIES))}"
        )
    return FAMILIES[model_type]


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
) -> PackedRow:
    """The packed micro-batch of `pairs` for a model of `config`: `pack_microbatch` (separate) or
    `pack_shared_prompt` (shared_prompt) of their ids, plus

    - the row's image inputs (`Family.row_images`): the images of every segment that holds them, in row
      order. Separate layout: both of a pair's segments hold its prompt, so its images go twice and the
      vision tower encodes them twice; shared_prompt: the prompt segment alone, once;
    - `segment_images` int32 [S]: how many images (Qwen2.5-VL) or crops (Idefics3) each segment holds;
    - Qwen2.5-VL: `model_position_ids` [4, 1, T] (`rope.row_positions`), what the model's rotary embedding reads.

    Every pair is checked first: its prompt's image placeholders must be as many as its images fill, and
    its completions must hold none (a DataError naming the pair, the counts and the fix)."""
    from dpo_data.loading import rope

    family = vision_family(config)
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
