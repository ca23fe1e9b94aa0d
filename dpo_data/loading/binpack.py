"""Pure packing: pairs into token-budgeted micro-batches (first-fit decreasing), micro-batches dealt to ranks."""

from __future__ import annotations

import heapq

import numpy as np


def deal(bins: list[list[int]], sizes: np.ndarray, world_size: int) -> list[list[list[int]]]:
    """Deal packed bins out to ranks: fullest first, each to the rank with the fewest bins, then the
    fewest tokens, then the lowest number. Bin counts differ by at most one; order is deterministic."""
    totals = [int(sizes[b].sum()) for b in bins]
    heap = [(0, 0, r) for r in range(world_size)]
    out: list[list[list[int]]] = [[] for _ in range(world_size)]
    for j in sorted(range(len(bins)), key=lambda j: (-totals[j], j)):
        count, load, rank = heapq.heappop(heap)
        out[rank].append(bins[j])
        heapq.heappush(heap, (count + 1, load + totals[j], rank))
    return out


def first_fit_decreasing(
    sizes: np.ndarray, capacity: int, max_bins: int | None = None
) -> tuple[list[list[int]], list[int]]:
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
