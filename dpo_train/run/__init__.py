"""The run room: one setup for training, precompute and evaluation, the preflight checks, the run directory,
the initial policy, and the run's logs and sinks."""
