"""The vision room: packed vision-language rows, their images in row order, and their exact per-pair scores.

- `families`: the VLM families a packed row can express, and the refusal, by name, of any other;
- `rope`: Qwen2.5-VL's 3D (M-RoPE) positions per segment, by the model class's own rule;
- `rows`: one packed micro-batch of `VisionPair`s (the text row of `dpo_data.loading.microbatch` plus images);
- `score`: per-pair log-probs of such a row through the attention room's packed path;
- `truth`: each sequence run alone through the model's own eager attention, what packing must reproduce.
"""

from dpo_train.front import front

# the front door: what the top floor will take from this room once the loader delivers vision rows
__all__, __getattr__ = front(
    __name__,
    {
        "rows": ("VisionPair", "pack_vision"),
        "score": ("vision_pair_logps",),
    },
)
