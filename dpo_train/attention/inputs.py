"""The model's keyword inputs for one packed row, per attention path (segments, sequence shard, or per-kind masks)."""

from __future__ import annotations

from typing import Any

from dpo_train.attention.features import text_config
from dpo_train.attention.flex import ATTENTION as FLEX_ATTENTION
from dpo_train.attention.masks import model_masks
from dpo_train.attention.segments import ATTENTION as SEGMENT_ATTENTION
from dpo_train.attention.segments import row_segments
from dpo_train.attention.sequence_parallel import split_row
from dpo_train.attention.unpacked import unpack
from dpo_train.attention.varlen import ATTENTION as VARLEN_ATTENTION
from dpo_train.errors import ModelError

PASSED = ("pixel_values", "image_grid_thw", "pixel_attention_mask")
"""Row keys handed to the model as they are: a vision-language row's images (`dpo_train.vision.rows`)."""


def attention_of(model: Any) -> str | None:
    """The attention implementation a Hugging Face model's decoder runs (through its wrappers; a
    vision-language model's text part, whose vision tower runs its own)."""
    return getattr(text_config(model), "_attn_implementation", None)


def passed_inputs(batch: dict[str, Any], path: str | None = None) -> dict[str, Any]:
    """The row's images and, where the row has them, the positions the model reads (`model_position_ids`:
    Qwen2.5-VL's [4, 1, T], the 1D positions then the 3D ones). `path`: a path that cannot carry images
    (unpacked, a sequence shard) refuses a row with them, never drops them."""
    found = {key: batch[key] for key in PASSED if key in batch}
    if "model_position_ids" in batch:
        found["position_ids"] = batch["model_position_ids"]
    if found and path is not None:
        raise ModelError(
            f"the {path} path cannot score a vision-language row (its images or 3D positions would be dropped); "
            "score it packed (dpo_train.vision.score.vision_pair_logps)"
        )
    return found


def row_inputs(
    batch: dict[str, Any], mesh: Any = None, model: Any = None, unpacked: bool = False
) -> tuple[dict[str, Any], Any]:
    """The model's keyword inputs for this rank's part of the row (all of it without sequence
    parallelism), and its sequence shard (None without sequence parallelism).

    - `unpacked` (`dpo_train.attention.unpacked`, a model packing cannot serve; the run's `Scoring.unpacked`): the
      row's sequences as a right-padded batch with the model's own 2D attention mask, positions from 0;
    - segment attention, flex and varlen: the row's segments go along and no mask exists (flex makes its block
      masks, varlen its cu_seqlens);
    - flash_attention_2 (separate layout only): no mask; transformers derives the segments' cu_seqlens
      from `position_ids` restarting at 0, and passes each layer's window and softcap to the kernel;
    - a vision-language row (`dpo_train.vision`) adds its images and the positions its model reads
      (`passed_inputs`); the unpacked and sequence-parallel paths refuse it;
    - transformers' sdpa and eager: the row's own masks, one per layer kind (window or chunk measured in
      positions), boolean for sdpa and additive for eager. Never transformers' own packed-sequence
      detection: a 4D mask given once would carry no window into any layer, and some models (GPT-OSS)
      build their masks without `position_ids`, so their packed segments would see each other.
    """
    if unpacked:  # never under sequence parallelism (refused at load)
        passed_inputs(batch, "unpacked")
        return dict(unpack(batch).inputs), None
    if mesh is not None and mesh.active:
        passed_inputs(batch, "sequence-parallel")
        part, shard = split_row(batch, mesh)
        inputs = {"input_ids": part["input_ids"], "position_ids": part["position_ids"], "use_cache": False}
        return {**inputs, "sequence_shard": shard}, shard
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    attention = attention_of(model)
    if attention in (SEGMENT_ATTENTION, FLEX_ATTENTION, VARLEN_ATTENTION):
        inputs["row_segments"] = row_segments(batch)
    elif attention in ("sdpa", "eager"):
        dtype = next(model.parameters()).dtype if attention == "eager" else None
        inputs["attention_mask"] = model_masks(batch, text_config(model), dtype)
    return {**inputs, **passed_inputs(batch)}, None
