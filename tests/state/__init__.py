"""Checkpoint state, attestations and the dpo-state commands."""
