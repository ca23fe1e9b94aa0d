"""Pure packing: a step's pairs shared out to ranks by tokens, each share packed into token-budgeted micro-batches
(first-fit decreasing)."""

from __future__ import annotations

import heapq

import numpy as np


def share(sizes: np.ndarray, parts: int) -> list[list[int]]:
    """Split positions of `sizes` into `parts` shares of nearly equal total size: largest first, each to the
    share with the smallest total so far (then the fewest items, then the lowest number), then `_even_out`.
    Each share lists its positions in ascending order; the split is deterministic."""
    heap = [(0, 0, p) for p in range(parts)]
    out: list[list[int]] = [[] for _ in range(parts)]
    for i in np.argsort(-sizes, kind="stable").tolist():
        load, count, part = heapq.heappop(heap)
        out[part].append(i)
        heapq.heappush(heap, (load + int(sizes[i]), count + 1, part))
    _even_out(out, [int(s) for s in sizes])
    return [sorted(s) for s in out]


def _even_out(shares: list[list[int]], sizes: list[int]) -> None:
    """Move or swap one item at a time between the busiest and the lightest share while that narrows their gap:
    greedy alone leaves a few percent over the mean when a step holds only a few items per share. Each move
    lowers the sum of squared loads, so this ends; the cap only bounds the time."""
    loads = [sum(sizes[i] for i in s) for s in shares]
    weight = np.asarray(sizes + [0], dtype=np.int64)  # position len(sizes): "no item", a plain move
    for _ in range(2 * len(sizes)):
        hi = max(range(len(shares)), key=lambda p: (loads[p], -p))
        lo = min(range(len(shares)), key=lambda p: (loads[p], p))
        gap = loads[hi] - loads[lo]
        give, take = np.asarray(shares[hi]), np.asarray(shares[lo] + [len(sizes)])
        # Giving a for b moves d = size(a) - size(b) from hi to lo: it helps when 0 < d < gap, most at gap / 2.
        d = weight[give][:, None] - weight[take][None, :]
        cost = np.where((d > 0) & (d < gap), np.abs(gap - 2 * d), np.iinfo(np.int64).max)
        if not len(give) or cost.min() == np.iinfo(np.int64).max:
            return
        row, col = np.unravel_index(int(cost.argmin()), cost.shape)
        a, b = int(give[row]), int(take[col])
        shares[hi].remove(a)
        shares[lo].append(a)
        if b != len(sizes):
            shares[lo].remove(b)
            shares[hi].append(b)
        loads[hi] -= int(d[row, col])
        loads[lo] += int(d[row, col])


def fill_shares(
    sizes: np.ndarray, capacity: int, parts: int, bins_per_part: int
) -> tuple[list[list[list[int]]], list[int]]:
    """Place positions of `sizes` into `parts` shares of `bins_per_part` bins of `capacity` each: largest first,
    each into the least-loaded share it fits (first fit among that share's bins, a new bin while it has fewer
    than `bins_per_part`). Returns (per share its bins, left_over in position order): what fits nowhere waits."""
    bins: list[list[list[int]]] = [[] for _ in range(parts)]
    room: list[list[int]] = [[] for _ in range(parts)]
    load = [0] * parts
    left: list[int] = []
    for i in np.argsort(-sizes, kind="stable").tolist():
        size = int(sizes[i])
        for p in sorted(range(parts), key=lambda p: (load[p], p)):
            b = next((b for b, free in enumerate(room[p]) if size <= free), None)
            if b is None and len(bins[p]) < bins_per_part:
                bins[p].append([])
                room[p].append(capacity)
                b = len(bins[p]) - 1
            if b is not None:
                bins[p][b].append(i)
                room[p][b] -= size
                load[p] += size
                break
        else:
            left.append(i)
    _even_out_bins(bins, room, load, [int(s) for s in sizes], capacity, bins_per_part)
    return [[b for b in share if b] for share in bins], sorted(left)


def _even_out_bins(
    bins: list[list[list[int]]], room: list[list[int]], load: list[int], sizes: list[int], capacity: int, most: int
) -> None:
    """`_even_out` for shares of bins: a move or swap between the busiest and the lightest share must also fit
    the bin it lands in. Placing alone leaves a share a few percent short where its bins fill unevenly."""
    none = len(sizes)
    weight = np.asarray(sizes + [0], dtype=np.int64)  # position `none`: no item (a plain move)
    for _ in range(2 * len(sizes)):
        hi = max(range(len(bins)), key=lambda p: (load[p], -p))
        lo = min(range(len(bins)), key=lambda p: (load[p], p))
        gap = load[hi] - load[lo]
        give = [(a, x) for x, b in enumerate(bins[hi]) for a in b]
        # What lo gives back in each bin y (or nothing), and the room bin y has: a new bin while lo has few.
        take = [(b, y, room[lo][y]) for y, items in enumerate(bins[lo]) for b in [none, *items]]
        take += [(none, -1, capacity)] if len(bins[lo]) < most else []
        if not give or not take or gap <= 0:
            return
        d = weight[[a for a, _ in give]][:, None] - weight[[b for b, _, _ in take]][None, :]
        fits = (d > 0) & (d < gap) & (d <= np.asarray([r for _, _, r in take])[None, :])
        cost = np.where(fits, np.abs(gap - 2 * d), np.iinfo(np.int64).max)
        if cost.min() == np.iinfo(np.int64).max:
            return
        row, col = np.unravel_index(int(cost.argmin()), cost.shape)
        (a, x), (b, y, _) = give[row], take[col]
        if y < 0:
            bins[lo].append([])
            room[lo].append(capacity)
        bins[hi][x].remove(a)
        bins[lo][y].append(a)
        if b != none:
            bins[lo][y].remove(b)
            bins[hi][x].append(b)
        moved = int(d[row, col])
        room[hi][x] += moved
        room[lo][y] -= moved
        load[hi] -= moved
        load[lo] += moved


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
