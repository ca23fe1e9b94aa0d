"""The reference room: the log-probs the loss compares the policy against, and held-out scoring.

- `choice`: the one `Reference` a run's loss sees (live, LoRA adapters off, precomputed sidecar or none)
  and its `logps(batch)`;
- `live`: the frozen initial policy, sharded from birth under FSDP2, or under LoRA the policy with its
  adapters off; TR-DPO's move of the copy toward the policy;
- `sidecar`: precomputed log-probs bound to the dataset and the reference weights, verified before use;
- `guard`: step 1's parity guard;
- `scoring`: every pair of a dataset scored without gradients, packed (sidecars and held-out eval).
"""

from dpo_train.front import front

# the front door: what the top floor (trainer, precompute, evaluation) takes from this room
__all__, __getattr__ = front(
    __name__,
    {
        "choice": ("build_reference",),
        "scoring": ("Scores", "score_pairs"),
        "sidecar": ("SIDECAR_DOCUMENT", "write_sidecar"),
    },
)
