"""Vectorised 64-bit hashing of token-id sequences: per-sequence identities and order-sensitive combinations."""

from __future__ import annotations

import numpy as np

M1, M2 = np.uint64(0xBF58476D1CE4E5B9), np.uint64(0x94D049BB133111EB)
GOLDEN = np.uint64(0x9E3779B97F4A7C15)
LANES = (np.uint64(0x243F6A8885A308D3), np.uint64(0x13198A2E03707344))
"""Two independent salts: every identity is two 64-bit lanes (128 bits), so a collision among a billion pairs has
a probability of about 1e-21 and is ignored."""


def mix(x: np.ndarray) -> np.ndarray:
    """splitmix64's finaliser, elementwise on uint64 (wrapping arithmetic is the point)."""
    with np.errstate(over="ignore"):
        x = (x ^ (x >> np.uint64(30))) * M1
        x = (x ^ (x >> np.uint64(27))) * M2
        return x ^ (x >> np.uint64(31))


def positions(offsets: np.ndarray) -> np.ndarray:
    """Each value's position within its sequence, for sequences delimited by `offsets` (n + 1 entries)."""
    lengths = np.diff(offsets)
    starts = np.repeat(offsets[:-1] - offsets[0], lengths)
    return np.arange(int(offsets[-1] - offsets[0]), dtype=np.int64) - starts


def sequence_hashes(offsets: np.ndarray, values: np.ndarray, salt: int = 0) -> np.ndarray:
    """[n, 2] uint64: each sequence's identity, from its values in order and its length (an empty sequence has
    one too). Every (value, position) is mixed alone and the mixes are summed per sequence, so no loop over rows:
    equal sequences hash equal, and a change of any value, of the order or of the length changes both lanes."""
    return prefix_hashes(offsets, values, np.diff(offsets), salt)


def prefix_hashes(offsets: np.ndarray, values: np.ndarray, lengths: np.ndarray, salt: int = 0) -> np.ndarray:
    """[n, 2]: the `sequence_hashes` of each sequence's first `lengths` values (each at most its length): a
    sequence's prefix hashes as the shorter sequence it equals would."""
    base = offsets[0]
    values = values[base : offsets[-1]]
    position = positions(offsets).astype(np.uint64)
    starts = offsets[:-1] - base
    out = np.empty((len(starts), 2), np.uint64)
    for lane, seed in enumerate(LANES):
        seed = seed ^ np.uint64(salt)
        sums = np.zeros(len(values) + 1, np.uint64)
        with np.errstate(over="ignore"):
            np.cumsum(mix(values.astype(np.uint64) ^ mix(position ^ seed)), out=sums[1:])
            ends = sums[starts + lengths] - sums[starts]
            out[:, lane] = mix(ends ^ mix(lengths.astype(np.uint64) + seed))
    return out


def combine(*parts: np.ndarray) -> np.ndarray:
    """[n, 2]: an order-sensitive combination of [n, 2] hashes (combine(a, b) != combine(b, a))."""
    out = parts[0].copy()
    with np.errstate(over="ignore"):
        for part in parts[1:]:
            out = mix(out * GOLDEN + part)
    return out


def first_index_of(queries: np.ndarray, table: np.ndarray) -> np.ndarray:
    """For each [2]-lane query, the smallest row index of `table` holding the same hash, or -1. Sorted by the first
    lane (stable, so the first of equal rows is the earliest), matched there and confirmed on the second."""
    out = np.full(len(queries), -1, np.int64)
    if not len(table) or not len(queries):
        return out
    order = np.argsort(table[:, 0], kind="stable")
    ordered = table[order, 0]
    at = np.minimum(np.searchsorted(ordered, queries[:, 0]), len(table) - 1)
    found = order[at]
    hit = (ordered[at] == queries[:, 0]) & (table[found, 1] == queries[:, 1])
    out[hit] = found[hit]
    return out
