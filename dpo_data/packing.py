"""Pure packing: split a step's pairs across ranks, and pack pairs into token-budgeted micro-batches."""

from __future__ import annotations

import heapq

import numpy as np


def split_across_ranks(sizes: np.ndarray, world_size: int) -> list[list[int]]:
    """Positions of `sizes` per rank, balancing tokens (longest first to the least-loaded rank).

    Deterministic: ties go to the earlier position and the lower rank.
    """
    loads = [(0, r) for r in range(world_size)]
    out: list[list[int]] = [[] for _ in range(world_size)]
    for i in np.argsort(-sizes, kind="stable").tolist():
        load, rank = heapq.heappop(loads)
        out[rank].append(i)
        heapq.heappush(loads, (load + int(sizes[i]), rank))
    return [sorted(positions) for positions in out]


def first_fit_decreasing(sizes: np.ndarray, capacity: int, max_bins: int | None = None) -> tuple[list[list[int]], list[int]]:
    """Pack positions of `sizes` into bins of `capacity`: largest first, each into the first bin it fits.

    Returns (bins, left_over): with `max_bins`, items that fit in none of the bins are left over, in
    position order. Every size must be <= capacity (the caller checks and names the pair).
    """
    bins: list[list[int]] = []
    room: list[int] = []
    left: list[int] = []
    for i in np.argsort(-sizes, kind="stable").tolist():
        size = int(sizes[i])
        for b, free in enumerate(room):
            if size <= free:
                bins[b].append(i)
                room[b] -= size
                break
        else:
            if max_bins is None or len(bins) < max_bins:
                bins.append([i])
                room.append(capacity - size)
            else:
                left.append(i)
    return bins, sorted(left)
