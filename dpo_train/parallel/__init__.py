"""The parallelism room: where a rank runs, the collectives it issues, and how the policy is sharded or wrapped.

- `device`: a rank's device, backend (gloo, nccl, hccl) and precision; joining the process group;
- `collectives`: every collective the project issues, on its backend's device (no other module calls one);
- `sharding`: FSDP2 `fully_shard` of the decoder layers, then the whole model;
- `wrapping`: the policy as it trains (DDP, FSDP2 or itself) and gradient accumulation without a sync.
"""

from dpo_train.front import front

# the front door: what the top floor (trainer, precompute, evaluation) takes from this room
__all__, __getattr__ = front(
    __name__,
    {
        "collectives": ("all_reduce", "barrier"),
        "wrapping": ("no_sync", "wrap"),
    },
)
