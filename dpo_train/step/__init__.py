"""The step room: one step's arithmetic: the loss family, the step objective, metrics, the non-finite vote,
AOT's sorts and early stopping."""
