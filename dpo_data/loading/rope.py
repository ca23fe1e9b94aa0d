"""Qwen2.5-VL's 3D (M-RoPE) positions for each segment of a packed row, by the model class's own rope-index rule."""

from __future__ import annotations

from typing import Any

import torch


class _Rule:
    """What `Qwen2_5_VLModel.get_rope_index` reads of its model: the config and `get_vision_position_ids`.
    The class's own functions run on it, so the positions are the model's, without a model: the loader's
    workers can compute them."""

    def __init__(self, config: Any):
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLModel

        self.config, self._model = config, Qwen2_5_VLModel

    def get_vision_position_ids(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self._model.get_vision_position_ids(self, *args, **kwargs)

    def positions(self, ids: torch.Tensor, grids: torch.Tensor | None) -> torch.Tensor:
        """[3, L] positions of one sequence `ids` [L] whose images have `grids` [n, 3] (None: no image)."""
        types = (ids == self.config.image_token_id).int()  # the processor's mm_token_type_ids: 1 for an image
        grids = grids if grids is not None and len(grids) else None
        found, _ = self._model.get_rope_index(self, ids[None], types[None], image_grid_thw=grids)
        return found[:, 0]


def row_positions(config: Any, batch: dict[str, Any], grids: list[torch.Tensor | None]) -> torch.Tensor:
    """[4, 1, T] position ids for the packed row, as Qwen2.5-VL's text model takes packed rows: the row's 1D
    positions (each segment's own, which the attention paths read), then each segment's 3D positions. A
    segment's 3D positions are those of its sequence run alone: computed over its context segment's ids
    (the shared prompt) followed by its own, with the images of both (`grids[s]`: segment s's own images'
    grids, None for none), and cut to its own tokens."""
    rule = _Rule(config)
    ids = batch["input_ids"][0]
    bounds = batch["cu_seqlens"].long().tolist()
    context = batch["segment_context"].tolist() if "segment_context" in batch else [-1] * (len(bounds) - 1)
    parts = []
    for s in range(len(bounds) - 1):
        own = ids[bounds[s] : bounds[s + 1]]
        owners = ([context[s]] if context[s] >= 0 else []) + [s]
        sequence = torch.cat([ids[bounds[o] : bounds[o + 1]] for o in owners])
        found = [grids[o] for o in owners if grids[o] is not None]
        parts.append(rule.positions(sequence, torch.cat(found) if found else None)[:, -len(own) :])
    rope = torch.cat(parts, dim=1) if parts else ids.new_zeros(3, 0)
    return torch.cat([batch["position_ids"].to(rope.dtype), rope])[:, None]
