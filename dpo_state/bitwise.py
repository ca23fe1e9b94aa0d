"""Two tensors compared bit for bit, and the first difference named: what a read-back check reports."""

from __future__ import annotations

from typing import Any


def bitwise_difference(name: str, kept: Any, read: Any) -> str:
    """How `read` (a tensor read back) differs from `kept` (the one written), bit for bit, or "" when it does not.
    Bytes, not values, are compared: a NaN read back as the same NaN is equal, -0.0 for 0.0 is not."""
    import torch

    kept = kept.detach()
    if kept.dtype != read.dtype or kept.shape != read.shape:
        return f"{name} read back as {read.dtype} {tuple(read.shape)}, written as {kept.dtype} {tuple(kept.shape)}"
    bits = [t.reshape(-1).contiguous().view(torch.uint8).reshape(t.numel(), -1) for t in (kept, read)]
    if torch.equal(*bits):
        return ""
    differ = (bits[0] != bits[1]).any(dim=1)
    first = int(differ.nonzero()[0])
    return (
        f"{name}: {int(differ.sum())} of {kept.numel()} values differ from what was written (the first, at flat "
        f"index {first}: {kept.reshape(-1)[first].item()!r} written, {read.reshape(-1)[first].item()!r} read back)"
    )
