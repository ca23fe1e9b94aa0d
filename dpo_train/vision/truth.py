"""Each vision-language sequence run alone through the model's own eager attention: what a packed row must equal."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from dpo_train.attention.features import attention_as, model_config, text_config
from dpo_train.vision.families import family_of


def eager_unpacked_vision(model: Any, pairs: list[Any], grad: bool = False) -> torch.Tensor:
    """[pairs, 2] completion log-prob sums: each prompt + completion run alone, with its prompt's images as
    its processor hands them over and the model computing its own positions (Qwen2.5-VL: from
    `mm_token_type_ids`, as the processor returns them), through the decoder's eager attention with no mask.
    `grad`: keep the graph (to compare gradients), else none."""
    family = family_of(model_config(model))
    device = next(model.parameters()).device
    image_token = model_config(model).image_token_id
    with attention_as(text_config(model), "eager"):
        with torch.set_grad_enabled(grad):
            rows = []
            for pair in pairs:
                sides = []
                for completion in (pair.ids.chosen, pair.ids.rejected):
                    ids = torch.as_tensor(np.concatenate([pair.ids.prompt, completion]), dtype=torch.long)
                    inputs = family.sequence_inputs(ids, pair.images)
                    if family.rope:
                        inputs["mm_token_type_ids"] = (ids == image_token).int()[None]
                    inputs = {k: v.to(device) for k, v in inputs.items()}
                    logits = model(input_ids=ids[None].to(device), use_cache=False, **inputs).logits[0].double()
                    n = len(pair.ids.prompt)
                    picked = torch.log_softmax(logits[n - 1 : -1], -1).gather(1, ids[n:, None].to(device))
                    sides.append(picked.sum())
                rows.append(torch.stack(sides))
            return torch.stack(rows)
