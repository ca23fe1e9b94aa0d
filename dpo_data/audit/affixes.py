"""The tokens every prompt starts and ends with: a chat template's system prompt and its generation header."""

from __future__ import annotations

import numpy as np

CAP = 512
"""The longest shared prefix or suffix looked for, in tokens."""
MIN_PROMPTS = 8
"""Fewer distinct prompts cannot tell a template's text from their own: no tokens are then set aside."""


def _edge(offsets: np.ndarray, values: np.ndarray, front: bool) -> np.ndarray:
    """[rows, CAP] of each sequence's first (or last, right to left) CAP tokens, -1 past its length."""
    lengths = np.diff(offsets)
    step = np.arange(CAP)
    at = offsets[:-1, None] + step if front else offsets[1:, None] - 1 - step
    inside = step[None, :] < lengths[:, None]
    return np.where(inside, values[np.clip(at, 0, max(len(values) - 1, 0))] if len(values) else -1, -1)


def shared(current: np.ndarray | None, offsets: np.ndarray, values: np.ndarray, front: bool) -> np.ndarray:
    """The tokens shared by `current` (None: nothing seen yet) and every sequence of a batch, at its front or its
    back (a suffix is returned in reading order)."""
    if len(offsets) < 2:
        return current
    edges = _edge(offsets, values, front)
    reference = edges[0] if current is None else _pad(current if front else current[::-1])
    equal = (edges == reference[None, :]) & (edges >= 0)
    length = int(np.cumprod(equal, axis=1).sum(axis=1).min())
    found = reference[:length]
    return found if front else found[::-1]


def _pad(tokens: np.ndarray) -> np.ndarray:
    out = np.full(CAP, -1, np.int64)
    out[: len(tokens)] = tokens
    return out


def occurs_before_end(offsets: np.ndarray, values: np.ndarray, marker: np.ndarray) -> np.ndarray:
    """Per sequence: whether `marker` occurs in it other than as its ending (a prompt holding the generation header
    earlier holds an earlier assistant turn). False everywhere for an empty marker."""
    rows = len(offsets) - 1
    out = np.zeros(rows, bool)
    m = len(marker)
    span = values[offsets[0] : offsets[-1]]
    if m == 0 or len(span) < m:
        return out
    hit = np.ones(len(span) - m + 1, bool)
    for j, token in enumerate(marker):
        hit &= span[j : len(span) - m + 1 + j] == token
    at = np.nonzero(hit)[0] + offsets[0]
    row = np.searchsorted(offsets, at, "right") - 1
    out[row[at + m < offsets[row + 1]]] = True
    return out


def cut_lengths(offsets: np.ndarray, values: np.ndarray, known: list[np.ndarray], front: bool) -> np.ndarray:
    """Per sequence, the length of the longest of the `known` token runs it starts (or ends) with; 0 for none."""
    out = np.zeros(len(offsets) - 1, np.int64)
    if not known or len(offsets) < 2:
        return out
    edges = _edge(offsets, values, front)
    for run in known:
        ordered = run if front else run[::-1]
        match = (edges[:, : len(run)] == ordered[None, :]).all(axis=1)
        out = np.where(match, np.maximum(out, len(run)), out)
    return out
