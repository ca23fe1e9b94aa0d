"""End-of-step agreement over ranks: which saw a non-finite loss, log-prob or gradient norm; the step's pair count."""

from __future__ import annotations

import math

import torch

from dpo_train.parallel import collectives
from dpo_train.step.metrics import SUMS

CHECKED = {"loss": "loss", "chosen_logp": "logps/chosen", "rejected_logp": "logps/rejected"}
"""Step sums whose non-finite value stops the step, and their metric names."""


def local_nonfinite(sums: torch.Tensor, grad_norm: float) -> list[str]:
    """The metrics this rank saw go non-finite in the step (before any reduction): from its own step sums
    and the step's gradient norm (already global: every rank clips the same gradient)."""
    bad = [name for key, name in CHECKED.items() if not math.isfinite(float(sums[0, SUMS.index(key)]))]
    return bad + ([] if math.isfinite(grad_norm) else ["grad_norm"])


def agree(flag: bool, step_pairs: int, rank: int, world: int) -> tuple[list[int], int, int]:
    """(ranks that raised `flag`, smallest and largest `step_pairs` over ranks), from one `spread` of a
    one-hot vector and the pair count. Every rank must call."""
    values = torch.zeros(world + 1, dtype=torch.float64)
    values[rank], values[world] = float(flag), float(step_pairs)
    lo, hi = (x.tolist() for x in collectives.spread(values))
    return [r for r, f in enumerate(hi[:world]) if f], int(lo[world]), int(hi[world])


def step_sources(sums: torch.Tensor, sources: list[str]) -> list[str]:
    """Names of the sources whose pairs are in the step (rows 1.. of the reduced sums)."""
    pairs = SUMS.index("pairs")
    return [name for name, row in zip(sources, sums[1:].tolist()) if row[pairs]]
