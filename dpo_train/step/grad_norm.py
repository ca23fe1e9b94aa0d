"""The step gradient's norm computed apart from torch's `clip_grad_norm_`, to check what it clips by once per run."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from dpo_train.parallel import collectives

TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-6}
"""How far `clip_grad_norm_` may be from the norm summed here, relative: float32 gradients sum in another order;
lower precisions (bf16 gradients of a model trained in bf16 without FSDP2) round each element's square."""
LOW_PRECISION_TOLERANCE = 2e-2
CLIP = "torch.nn.utils.clip_grad_norm_"


def gradient_norm(parameters: Iterable[torch.Tensor]) -> float:
    """The 2-norm of every gradient together. A DTensor gradient (FSDP2) contributes its local part's squares,
    summed over the mesh dimensions it is sharded on, once for a dimension it is replicated on; a plain one
    (DDP, one process: every rank holds the whole gradient) contributes its own. Each gradient's squares are
    reduced on its device in float32 and added on the host in float64 (across ranks in float32): rounding far
    below TOLERANCE."""
    from torch.distributed.tensor import DTensor, Shard

    total, shards = 0.0, {}
    for parameter in parameters:
        grad = parameter.grad
        if grad is None:
            continue
        if not isinstance(grad, DTensor):
            total += _squares(grad)
            continue
        dims = tuple(i for i, placement in enumerate(grad.placements) if isinstance(placement, Shard))
        key = (grad.device_mesh, dims)
        shards[key] = shards.get(key, 0.0) + _squares(grad.to_local())
    for (mesh, dims), squares in shards.items():  # in insertion order: the same on every rank
        summed = torch.tensor([squares], dtype=torch.float32)  # float32: every backend reduces it (HCCL too)
        for dim in dims:
            summed = collectives.all_reduce(summed, group=mesh.get_group(dim))
        total += float(summed)
    return math.sqrt(total)


def _squares(grad: torch.Tensor) -> float:
    """The sum of squares of `grad`'s elements, one float32 reduction on its device (no float64 copy of it)."""
    return float(torch.linalg.vector_norm(grad, dtype=torch.float32)) ** 2


def norm_mismatch(reported: float, independent: float, dtypes: set[torch.dtype]) -> str | None:
    """Why `reported` (clip_grad_norm_'s) is not `independent` (gradient_norm's), or None when it is, within the
    gradients' precision. Non-finite norms are the non-finite check's, not this one's."""
    if not (math.isfinite(reported) and math.isfinite(independent)):
        return None
    tolerance = max(TOLERANCE.get(d, LOW_PRECISION_TOLERANCE) for d in dtypes) if dtypes else TOLERANCE[torch.float32]
    if abs(reported - independent) <= tolerance * max(abs(independent), 1e-30):
        return None
    return (
        f"{CLIP} returned a gradient norm of {reported:.6g}, but the gradients' own norm, "
        f"summed over every rank's part, is {independent:.6g} ({abs(reported / independent - 1):.1%} off, beyond "
        f"{tolerance:.0e} relative)"
    )
