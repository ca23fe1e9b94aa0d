"""The optimizer and its learning-rate schedule, built from the run's `optim` section."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch

SCHEDULES: dict[str, Callable[[float], float]] = {
    "constant": lambda progress: 1.0,
    "linear": lambda progress: 1.0 - progress,
    "cosine": lambda progress: 0.5 * (1.0 + math.cos(math.pi * progress)),
}
"""optim.scheduler -> the learning rate's factor at `progress` (0 to 1) through the steps after the warm-up: the one
table of schedules (the config schema's enum and the TRL translation's targets are checked against it,
tests/train/config/test_config.py)."""


def build_optimizer(parameters: Iterable[torch.nn.Parameter], optim: Any) -> torch.optim.Optimizer:
    """The optimizer `optim` (the config's `optim` section) names over the parameters that train (under LoRA, the
    adapters: frozen base weights get no optimizer state)."""
    params = [p for p in parameters if p.requires_grad]
    if optim.name == "sgd":
        return torch.optim.SGD(params, lr=optim.lr, weight_decay=optim.weight_decay)
    return torch.optim.AdamW(
        params, lr=optim.lr, betas=tuple(optim.betas), eps=optim.eps, weight_decay=optim.weight_decay
    )


def build_schedule(optimizer: torch.optim.Optimizer, optim: Any, total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    """`optim.scheduler` over a run of `total_steps` optimizer steps: a linear warm-up over `optim.warmup_for(
    total_steps)` steps (step k at (k + 1) / (warm-up + 1)), then the schedule's shape over the rest."""
    warmup, shape = optim.warmup_for(total_steps), SCHEDULES[optim.scheduler]

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / (warmup + 1)
        return shape(min(1.0, (step - warmup) / max(1, total_steps - warmup)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
