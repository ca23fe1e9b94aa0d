"""The audit's numbers from its findings: counts, length bias, lengths, multi-turn share; overall or per source."""

from __future__ import annotations

from typing import Any

import numpy as np

from dpo_data.audit.findings import DEGENERATE_KINDS, Findings

QUANTILES = (10, 25, 50, 75, 90, 99)


def measures(findings: Findings, lengths: np.ndarray, rows: np.ndarray, against: bool) -> dict[str, Any]:
    """Every measure over the pairs `rows` (a bool mask); `lengths` is [pairs, 3] (prompt, chosen, rejected)."""
    near = findings.near_duplicate_of[rows]
    return {
        "pairs": int(rows.sum()),
        "exact_duplicates": int((findings.duplicate_of[rows] >= 0).sum()),
        "conflicting_pairs": int((findings.conflicts_with[rows] >= 0).sum()),
        "near_duplicate_prompts": int((near >= 0).sum()),
        "near_duplicate_clusters": int(len(np.unique(near[near >= 0]))),
        "contaminated_prompts": int((findings.contaminated_by[rows] >= 0).sum()) if against else None,
        "length_bias": length_bias(lengths[rows, 1], lengths[rows, 2]),
        "degenerate_pairs": degenerate_counts(findings.degenerate, rows),
        "lengths": {
            "prompt": quantiles(lengths[rows, 0]),
            "chosen": quantiles(lengths[rows, 1]),
            "rejected": quantiles(lengths[rows, 2]),
            "pair": quantiles(lengths[rows].sum(axis=1)),
        },
        "multi_turn": share(int(findings.multi_turn[rows].sum()), int(rows.sum())),
    }


def length_bias(chosen: np.ndarray, rejected: np.ndarray) -> dict[str, float | int | None]:
    """How much longer chosen completions are: the fraction of pairs with a longer chosen among those whose
    lengths differ, the mean and median of ln(chosen / rejected), and Cohen's d of chosen against rejected lengths
    (mean difference over the pooled standard deviation). None where undefined (no pair, or no spread)."""
    c, r = chosen.astype(np.float64), rejected.astype(np.float64)
    differ = int((c != r).sum())
    ratio = np.log(np.maximum(c, 1) / np.maximum(r, 1))
    pooled = np.sqrt((c.var() + r.var()) / 2) if len(c) else 0.0
    return {
        "pairs_differing": differ,
        "fraction_chosen_longer": _round(float((c > r).sum()) / differ) if differ else None,
        "mean_log_ratio": _round(float(ratio.mean())) if len(c) else None,
        "median_log_ratio": _round(float(np.median(ratio))) if len(c) else None,
        "cohens_d": _round(float((c.mean() - r.mean()) / pooled)) if pooled > 0 else None,
    }


def degenerate_counts(kinds: dict[str, np.ndarray | None], rows: np.ndarray) -> dict[str, int | None]:
    """Pairs of each degenerate kind (None: not measured), and of any kind (a pair may be of several)."""
    counts: dict[str, int | None] = {
        kind: None if kinds[kind] is None else int(kinds[kind][rows].sum()) for kind in DEGENERATE_KINDS
    }
    measured = [kinds[k][rows] for k in DEGENERATE_KINDS if kinds[k] is not None]
    counts["any"] = int(np.logical_or.reduce(measured).sum()) if measured else 0
    return counts


def quantiles(values: np.ndarray) -> dict[str, float | int]:
    """min, p10 ... p99, max (tokens, as held: the 'higher' of two) and the mean; zeros when empty."""
    if not len(values):
        return {"min": 0, **{f"p{q}": 0 for q in QUANTILES}, "max": 0, "mean": 0.0}
    points = np.percentile(values, QUANTILES, method="higher")
    return {
        "min": int(values.min()),
        **{f"p{q}": int(v) for q, v in zip(QUANTILES, points)},
        "max": int(values.max()),
        "mean": _round(float(values.mean())),
    }


def share(count: int, total: int) -> dict[str, float | int]:
    return {"pairs": count, "share": _round(count / total) if total else 0.0}


def _round(x: float) -> float:
    return round(x, 6)
