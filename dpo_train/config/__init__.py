"""The config room: the YAML config's typed sections, loading (`--set`, unknown keys named, schema), the rules
between settings, strict YAML, and TRL's names and the translation of a TRL config through them."""

from dpo_train.front import front

# the front door: what the top floor (trainer, precompute, evaluation) takes from this room
__all__, __getattr__ = front(
    __name__,
    {
        "sections": ("TrainConfig",),
    },
)
