"""The model room: loading the policy (with the attention path that fits it), LoRA, and the bundled SmolLM2."""

from dpo_train.front import front

# the front door: what the top floor (trainer, precompute, evaluation) takes from this room
__all__, __getattr__ = front(
    __name__,
    {
        "lora": ("apply_lora",),
        "policy": ("embedding_rows", "reached_by_every_rank"),
    },
)
