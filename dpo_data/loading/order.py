"""The order of pairs in an epoch: a pure function of (seed, epoch, dataset fingerprint) and the mixture weights."""

from __future__ import annotations

import hashlib
import math

import numpy as np

from dpo_data.errors import DataError


def _generator(seed: int, epoch: int, fingerprint: str, stream: int) -> np.random.PCG64:
    digest = hashlib.sha256(fingerprint.encode()).digest()
    words = [int.from_bytes(digest[i : i + 4], "little") for i in range(0, 16, 4)]
    return np.random.PCG64(np.random.SeedSequence([seed, epoch, stream, *words]))


def _random_keys(gen: np.random.PCG64, n: int) -> np.ndarray:
    # Raw 64-bit draws are part of PCG64's fixed definition; Generator methods such as permutation()
    # may change between numpy versions, which would silently change a resumed run's order.
    return gen.random_raw(n)


def permutation(n: int, seed: int, epoch: int, fingerprint: str, stream: int = 0) -> np.ndarray:
    """A permutation of range(n), the same for the same arguments on any machine and numpy version."""
    return np.argsort(_random_keys(_generator(seed, epoch, fingerprint, stream), n), kind="stable").astype(np.int64)


def check_weights(weights: list[float], sizes: list[int]) -> None:
    if len(weights) != len(sizes):
        raise DataError(f"{len(weights)} weights given for {len(sizes)} datasets; give one weight per dataset")
    for i, w in enumerate(weights):
        if not (isinstance(w, (int, float)) and math.isfinite(w) and w >= 0):
            raise DataError(
                f"weight {w!r} of dataset {i}: weights must be finite numbers >= 0 (1 = each pair once per epoch)"
            )
    if not any(round(w * n) for w, n in zip(weights, sizes)):
        raise DataError(f"weights {weights} select no pair at all; give at least one dataset a positive weight")


def epoch_order(sizes: list[int], weights: list[float], seed: int, epoch: int, fingerprint: str) -> np.ndarray:
    """Global pair indices of one epoch, in order.

    Dataset d (its pairs at global offsets of `sizes`) contributes round(w_d * n_d) pairs: every pair
    floor(w_d) times, plus a subset for the fractional part chosen by (seed, epoch). With all weights
    1, this is a permutation of every pair exactly once.
    """
    check_weights(weights, sizes)
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    picks = []
    for d, (n, w) in enumerate(zip(sizes, weights)):
        whole, want = int(math.floor(w)), int(round(w * n))
        extra = want - whole * n
        base = np.arange(offsets[d], offsets[d] + n, dtype=np.int64)
        picks += [base] * whole
        if extra > 0:
            picks.append(np.sort(permutation(n, seed, epoch, fingerprint, stream=1 + d)[:extra]) + offsets[d])
    chosen = np.concatenate(picks) if picks else np.zeros(0, dtype=np.int64)
    return chosen[permutation(len(chosen), seed, epoch, fingerprint)]
