"""The vision room: packed vision-language rows, their images in row order, and their exact per-pair scores.

- `families`: the VLM families a packed row can express, and the refusal, by name, of any other;
- `rows`: one packed micro-batch of `VisionPair`s (built by the loader: `dpo_data.loading.vision`, with
  Qwen2.5-VL's 3D positions from `dpo_data.loading.rope`);
- `score`: per-pair log-probs of such a row through the attention room's packed path;
- `truth`: each sequence run alone through the model's own eager attention, what packing must reproduce.
"""

from dpo_train.front import front

# the front door: what the top floor takes from this room
__all__, __getattr__ = front(
    __name__,
    {
        "rows": ("VisionPair", "pack_vision"),
        "score": ("vision_pair_logps",),
    },
)
