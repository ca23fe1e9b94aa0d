"""The trainer: config, objective, losses, log-probs, parallelism, reference, precision, sinks, exact resume."""
