"""Small collectives the trainer's checks share: every rank calls them, a single process skips them."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist


def gather_failures(failure: str, world: int, device: torch.device | str = "cpu") -> list[str]:
    """Every rank's failure message (empty strings dropped), known to every rank: one all-reduce of a
    flag on `device` (the backend's: cpu for gloo), then an in-memory gather between live ranks only
    when some rank failed."""
    if world == 1:
        return [failure] if failure else []
    flags = torch.tensor([1 if failure else 0], dtype=torch.int64, device=device)
    dist.all_reduce(flags)
    if not int(flags):
        return []
    messages: list[Any] = [None] * world
    dist.all_gather_object(messages, failure)  # in-memory between live ranks, never from disk
    return [m for m in messages if m]


def gather_objects(value: Any, world: int) -> list[Any]:
    """Every rank's small JSON-like `value`, in rank order, on every rank (in memory between live ranks)."""
    if world == 1:
        return [value]
    values: list[Any] = [None] * world
    dist.all_gather_object(values, value)
    return values


def broadcast_from_rank0(value: Any, world: int, device: torch.device | str = "cpu") -> Any:
    """Rank 0's small `value`, on every rank."""
    if world == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, device=torch.device(device))
    return box[0]
