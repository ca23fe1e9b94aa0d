"""Near-duplicate prompts: MinHash signatures over token n-grams (vectorised numpy), LSH banding, components.

A prompt's n-grams are hashed (`shingles`), each hash goes through `NUM_PERM` random permutations of 32-bit words
(x -> a x + b mod 2^32, fixed seed), and a prompt keeps the smallest of each, cut to 16 bits: 256 bytes a
prompt (`signatures`). The fraction of equal entries of two signatures estimates the Jaccard similarity of their
n-gram sets (standard error sqrt(J (1 - J) / 128), 0.035 at J = 0.8; 16-bit entries add 1/65536). LSH: 32 bands
of 4 entries; two prompts sharing a band become a candidate, kept when their estimate reaches the threshold. A
pair at similarity s becomes a candidate with probability 1 - (1 - s^4)^32: 0.99999998 at 0.8, 0.87 at 0.5.
"""

from __future__ import annotations

import numpy as np

from dpo_data.audit.hashing import GOLDEN, mix

NUM_PERM = 128
BANDS, ROWS = 32, 4
SEED = 20260507
CHUNK_SHINGLES = 1 << 14
"""Shingles permuted at once: [CHUNK_SHINGLES, NUM_PERM] uint32 is 8 MiB, whatever the dataset's size."""
VERIFY_CHUNK = 1 << 16


def _permutations() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(SEED)
    a = rng.integers(0, 1 << 31, NUM_PERM, dtype=np.uint32) * np.uint32(2) + np.uint32(1)  # odd: a bijection
    return a, rng.integers(0, 1 << 32, NUM_PERM, dtype=np.uint64).astype(np.uint32)


PERM_A, PERM_B = _permutations()


def shingles(
    values: np.ndarray, starts: np.ndarray, ends: np.ndarray, n: int, salt: np.ndarray
) -> tuple[np.ndarray, np.ndarray]:
    """Each row's n-gram hashes over values[starts:ends] (absolute positions into `values`, rows in order), and
    the number per row: a row of fewer than n tokens has one, the hash of all of them (none: a fixed one). Each
    hash is xor-ed with its row's `salt` (a vision prompt's images), so prompts with other images share none."""
    lengths = ends - starts
    counts = np.maximum(lengths - n + 1, 1)
    v = values.astype(np.uint64)
    with np.errstate(over="ignore"):
        grams = mix(v[n - 1 :] + GOLDEN * np.uint64(n))
        for j in range(n - 2, -1, -1):
            grams = mix(v[j : len(v) - (n - 1 - j)] ^ (grams * GOLDEN))
        total = np.zeros(len(v) + 1, np.uint64)
        np.cumsum(mix(v ^ GOLDEN), out=total[1:])
        whole = mix((total[ends] - total[starts]) ^ mix(lengths.astype(np.uint64)))
    first = np.repeat(np.cumsum(counts) - counts, counts)
    at = np.repeat(starts, counts) + (np.arange(int(counts.sum())) - first)
    long = np.repeat(lengths >= n, counts)
    out = np.where(long, grams[np.minimum(at, max(len(grams) - 1, 0))] if len(grams) else 0, np.repeat(whole, counts))
    return out ^ np.repeat(salt, counts), counts


def signatures(hashes: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """[rows, NUM_PERM] uint16: each row's MinHash signature from its `counts` shingle hashes (in row order)."""
    words = (hashes >> np.uint64(32)).astype(np.uint32)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    out = np.empty((len(counts), NUM_PERM), np.uint16)
    row = 0
    while row < len(counts):
        last = max(row + 1, int(np.searchsorted(bounds, bounds[row] + CHUNK_SHINGLES, "right")) - 1)
        last = min(last, len(counts))
        chunk = words[bounds[row] : bounds[last]]
        with np.errstate(over="ignore"):
            permuted = chunk[:, None] * PERM_A[None, :] + PERM_B[None, :]
        out[row:last] = np.minimum.reduceat(permuted, bounds[row:last] - bounds[row], axis=0) >> np.uint32(16)
        row = last
    return out


def candidate_edges(signature: np.ndarray) -> np.ndarray:
    """[m, 2] int64 row pairs (a < b) sharing a band: in each band's buckets, every member is linked to the
    bucket's first and to the member before it (linear in the rows, however large a bucket)."""
    edges = []
    keys = np.ascontiguousarray(signature).view(np.uint64)  # 4 uint16 entries = one band, exactly
    for band in range(BANDS):
        order = np.argsort(keys[:, band], kind="stable")
        ordered = keys[order, band]
        same = ordered[1:] == ordered[:-1]
        if not same.any():
            continue
        run_start = np.maximum.accumulate(np.where(np.concatenate([[True], ~same]), np.arange(len(order)), 0))
        member = np.nonzero(np.concatenate([[False], same]))[0]
        edges.append(np.stack([order[run_start[member]], order[member]], axis=1))
        edges.append(np.stack([order[member - 1], order[member]], axis=1))
    if not edges:
        return np.zeros((0, 2), np.int64)
    pairs = np.sort(np.concatenate(edges), axis=1)
    return np.unique(pairs[pairs[:, 0] != pairs[:, 1]], axis=0)


def similar(signature: np.ndarray, edges: np.ndarray, threshold: float) -> np.ndarray:
    """The candidate edges whose estimated Jaccard similarity reaches `threshold`."""
    keep = np.zeros(len(edges), bool)
    for lo in range(0, len(edges), VERIFY_CHUNK):
        a, b = edges[lo : lo + VERIFY_CHUNK, 0], edges[lo : lo + VERIFY_CHUNK, 1]
        keep[lo : lo + VERIFY_CHUNK] = (signature[a] == signature[b]).mean(axis=1) >= threshold
    return edges[keep]


def components(count: int, edges: np.ndarray) -> np.ndarray:
    """Each of `count` nodes' smallest node in its connected component of `edges` (label propagation with
    pointer jumping: a few passes over the edges)."""
    labels = np.arange(count, dtype=np.int64)
    if not len(edges):
        return labels
    a, b = edges[:, 0], edges[:, 1]
    while True:
        before = labels.copy()
        low = np.minimum(labels[a], labels[b])
        np.minimum.at(labels, a, low)
        np.minimum.at(labels, b, low)
        labels = labels[labels]
        if np.array_equal(labels, before):
            return labels
