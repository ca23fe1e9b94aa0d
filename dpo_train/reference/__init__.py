"""The reference room: the log-probs the loss compares the policy against, and held-out scoring.

- `choice`: the one `Reference` a run's loss sees (live, LoRA adapters off, precomputed sidecar or none)
  and its `logps(batch)`;
- `live`: the frozen initial policy, sharded from birth under FSDP2, or under LoRA the policy with its
  adapters off; TR-DPO's move of the copy toward the policy;
- `sidecar`: precomputed log-probs bound to the dataset and the reference weights, verified before use;
- `guard`: step 1's parity guard;
- `scoring`: every pair of a dataset scored without gradients, packed (sidecars and held-out eval).
"""
