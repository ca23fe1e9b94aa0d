"""The VLM families a packed row can express (image inputs, token counts, positions); others refused by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dpo_data.errors import DataError
from dpo_train.errors import ConfigError


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


FAMILIES = {
    "qwen2_5_vl": Family("qwen2_5_vl", ("pixel_values", "image_grid_thw"), rope=True),
    "idefics3": Family("idefics3", ("pixel_values", "pixel_attention_mask"), rope=False),
}
"""model_type -> family: the families whose packed rows are proved equal to each sequence run alone
(tests/vision/test_packed_vision.py)."""

NOT_YET = {
    "qwen2_vl": "Qwen2-VL's rope rule and processor differ in details not yet checked",
    "qwen3_vl": "Qwen3-VL interleaves its M-RoPE sections and adds deepstack features not yet checked",
    "smolvlm": "SmolVLM's own class (Idefics3's near copy) is not yet checked",
    "llava": "LLaVA is not yet checked",
    "gemma3": "Gemma 3's images attend bidirectionally within each image, which the segment attention does not express",
    "mllama": "Mllama reads images through cross-attention layers, which the packed path does not express",
}
"""model_type -> why a known VLM family is refused for now (the message names it)."""


def family_of(config: Any) -> Family:
    """The family of a VLM config, or a ConfigError naming the model type, why, and the supported ones."""
    model_type = getattr(config, "model_type", None)
    if model_type in FAMILIES:
        return FAMILIES[model_type]
    why = NOT_YET.get(model_type, "it is not a vision-language family the packed path knows")
    raise ConfigError(
        f"model type {model_type}: cannot train packed vision-language pairs on it ({why}); supported: "
        f"{', '.join(sorted(FAMILIES))} (docs/vision.md)"
    )
