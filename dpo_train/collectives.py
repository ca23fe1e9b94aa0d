"""Every collective the project issues, on the device its backend reduces on; a single process skips them.

NCCL reduces only CUDA tensors and HCCL only NPU tensors; gloo reduces CPU tensors. The trainer's own
agreements (step sums, the non-finite vote, checkpoint steps, failure propagation, resume choice) all
go through this module, which moves each tensor to `device()` and back, so that no call site needs to
know the backend. Collectives issued inside torch (DDP, FSDP2, DCP) place their own tensors.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

_BACKEND_DEVICE = {"gloo": "cpu", "nccl": "cuda", "hccl": "npu"}


def active() -> bool:
    """True inside a process group of more than one rank: collectives are needed."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def device_for(backend: str) -> torch.device:
    """The device the `backend` reduces on: cpu for gloo (and gloo-first mixed backends such as
    "cpu:gloo,cuda:nccl"), this rank's current cuda or npu device for nccl or hccl."""
    kind = "cpu" if "gloo" in backend else _BACKEND_DEVICE.get(backend)
    if kind is None:
        known = ", ".join(_BACKEND_DEVICE)
        raise ValueError(f"no device known for process-group backend {backend!r}; expected one of {known}")
    if kind == "cpu":
        return torch.device("cpu")
    return torch.device(kind, getattr(torch, kind).current_device())


def device() -> torch.device:
    """The default process group's collective device (cpu without one)."""
    return device_for(dist.get_backend()) if active() else torch.device("cpu")


def all_reduce(tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
    """`tensor` summed (or "max", "min") over ranks, returned on `tensor`'s own device (a new tensor
    when it had to move; `tensor` itself otherwise)."""
    if not active():
        return tensor
    moved = tensor.to(device())
    dist.all_reduce(moved, op={"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}[op])
    return moved.to(tensor.device)


def barrier() -> None:
    """Wait for every rank (a no-op in one process)."""
    if not active():
        return
    where = device()
    dist.barrier(device_ids=[where.index] if where.type == "cuda" else None)


def gather_failures(failure: str) -> list[str]:
    """Every rank's failure message (empty strings dropped), known to every rank: one all-reduce of a
    flag, then an in-memory gather between live ranks only when some rank failed."""
    if not active():
        return [failure] if failure else []
    flags = all_reduce(torch.tensor([1 if failure else 0], dtype=torch.int64))
    if not int(flags):
        return []
    return [m for m in gather_objects(failure) if m]


def gather_objects(value: Any) -> list[Any]:
    """Every rank's small JSON-like `value`, in rank order, on every rank (in memory between live ranks,
    never read from disk; pickled by torch on the backend's device)."""
    if not active():
        return [value]
    values: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)  # on the current device, which `placement` set to this rank's
    return values


def broadcast_from_rank0(value: Any) -> Any:
    """Rank 0's small `value`, on every rank."""
    if not active():
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0, device=device())
    return box[0]
