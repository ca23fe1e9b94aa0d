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


def all_reduce(tensor: torch.Tensor, op: str = "sum", group: Any = None) -> torch.Tensor:
    """`tensor` summed (or "max", "min") over ranks (of `group`, default all), returned on `tensor`'s own
    device (a new tensor when it had to move; `tensor` itself otherwise)."""
    if not active():
        return tensor
    moved = tensor.to(device())
    ops = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}
    dist.all_reduce(moved, op=ops[op], group=group)
    return moved.to(tensor.device)


def spread(values: torch.Tensor, group: Any = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(smallest, largest) of `values` over ranks, element-wise: one MAX all-reduce of the values with both
    signs, so ranks agree (or see that they do not) in one collective instead of two."""
    both = all_reduce(torch.cat([values, -values]), "max", group=group)
    return -both[values.numel() :], both[: values.numel()]


def all_gather_rows(rows: torch.Tensor) -> torch.Tensor:
    """Every rank's `rows` [n_r, k] (n_r may differ between ranks, 0 included), concatenated in rank order,
    on every rank: one all-reduce of the counts, then one all-gather padded to the largest."""
    if not active():
        return rows
    rank, world = dist.get_rank(), dist.get_world_size()
    counts = torch.zeros(world, dtype=torch.int64)
    counts[rank] = len(rows)
    counts = all_reduce(counts)
    where = device()
    padded = torch.zeros(int(counts.max()), *rows.shape[1:], dtype=rows.dtype, device=where)
    padded[: len(rows)] = rows.to(where)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat([part[:count] for part, count in zip(parts, counts.tolist(), strict=True)]).to(rows.device)


def barrier() -> None:
    """Wait for every rank (a no-op in one process)."""
    if not active():
        return
    where = device()
    dist.barrier(device_ids=[where.index] if where.type == "cuda" else None)


def shutdown() -> None:
    """End the process group after a run every rank finished: gloo's worker threads must stop while the
    interpreter is alive, or its exit can abort (SIGABRT, "terminate called without an active
    exception"; pytorch/pytorch#190489)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


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


# Differentiable collectives inside one sequence-parallel group (dpo_train/sequence_parallel.py). They run
# on the tensors' own device: the activations are already where the group's backend reduces.


def sum_same_loss(partial: torch.Tensor, group: Any) -> torch.Tensor:
    """The sum of every group rank's `partial`, for a loss that every rank of the group then computes
    identically from it. Backward passes the gradient through unchanged: each rank's partial enters
    the (one) loss once, so its gradient is the loss's gradient with respect to the sum; summing the
    gradient as well (what a plain differentiable all-reduce does) would count it once per rank."""
    return _SumSameLoss.apply(partial, group)


def exchange(chunks: torch.Tensor, group: Any) -> torch.Tensor:
    """All-to-all: `chunks` [G, ...] sends chunk j to group rank j; the result's chunk j came from group
    rank j. Its own adjoint, so backward exchanges the gradient the same way."""
    return _Exchange.apply(chunks, group)


def gather_chunks(chunk: torch.Tensor, group: Any) -> torch.Tensor:
    """Every group rank's `chunk`, concatenated along dim 0 in group-rank order. Backward sums the
    gradients of all ranks and keeps this rank's slice (a reduce-scatter)."""
    return _GatherChunks.apply(chunk, group)


def _newest(*names: str):
    """torch 2.13 renamed the single-tensor collectives (the old names warn); torch >= 2.6 has the old
    ones. Looked up at each call, so that wrappers (tests, benchmarks) see every call."""
    return next(getattr(dist, name) for name in names if hasattr(dist, name))


class _SumSameLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, partial, group):
        total = partial.contiguous().clone()
        dist.all_reduce(total, group=group)
        return total

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, chunks, group):
        ctx.group = group
        return _exchange(chunks, group)

    @staticmethod
    def backward(ctx, grad):
        return _exchange(grad, ctx.group), None


def _exchange(chunks: torch.Tensor, group: Any) -> torch.Tensor:
    chunks = chunks.contiguous()
    out = torch.empty_like(chunks)
    dist.all_to_all_single(out, chunks, group=group)
    return out


class _GatherChunks(torch.autograd.Function):
    @staticmethod
    def forward(ctx, chunk, group):
        ctx.group = group
        size = dist.get_world_size(group)
        out = chunk.new_empty((size * chunk.shape[0], *chunk.shape[1:]))
        _newest("all_gather_single", "all_gather_into_tensor")(out, chunk.contiguous(), group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        size = dist.get_world_size(ctx.group)
        mine = grad.new_empty((grad.shape[0] // size, *grad.shape[1:]))
        _newest("reduce_scatter_single", "reduce_scatter_tensor")(mine, grad.contiguous(), group=ctx.group)
        return mine, None
