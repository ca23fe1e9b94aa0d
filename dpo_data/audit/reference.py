"""`dpo-data audit --reference SIDECAR`: the reference model's implicit margins (chosen minus rejected log-prob),
per source, and the pairs it prefers the other way round most strongly (candidates for label noise)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from dpo_data.dataset.store import PairStore
from dpo_data.errors import DataError

MARGIN_QUANTILES = (1, 10, 50, 90, 99)


def reference_margins(store: PairStore, sidecar: str | Path, table: tuple, top: int = 20) -> dict[str, Any]:
    """The margins of the sidecar at `sidecar` over `store`'s pairs, from its `reference_table`; pairs the sidecar
    did not score (--only-planned) are left out and counted."""
    chosen, rejected, record = table
    margin = chosen - rejected
    scored = ~np.isnan(margin)
    order = np.argsort(np.where(scored, margin, np.inf), kind="stable")[: min(top, int(scored.sum()))]
    return {
        "sidecar": str(sidecar),
        "weights_fingerprint": record["reference"]["weights_fingerprint"],
        "unscored_pairs": int((~scored).sum()),
        "margins": margin_stats(margin[scored]),
        "sources": {
            name: margin_stats(margin[scored & (store.source_id == k)]) for k, name in enumerate(store.sources)
        },
        "reversed": [
            {
                "pair": int(i),
                "source": store.sources[store.source_id[i]],
                "margin": round(float(margin[i]), 6),
                "chosen_logp": round(float(chosen[i]), 6),
                "rejected_logp": round(float(rejected[i]), 6),
            }
            for i in order
            if margin[i] < 0
        ],
    }


def margin_stats(margin: np.ndarray) -> dict[str, Any]:
    """How many pairs, the mean, quantiles, and the fraction the reference prefers the rejected (margin < 0)."""
    if not len(margin):
        return {"pairs": 0, "mean": None, **{f"p{q}": None for q in MARGIN_QUANTILES}, "fraction_negative": None}
    points = np.percentile(margin, MARGIN_QUANTILES)
    return {
        "pairs": int(len(margin)),
        "mean": round(float(margin.mean()), 6),
        **{f"p{q}": round(float(v), 6) for q, v in zip(MARGIN_QUANTILES, points)},
        "fraction_negative": round(float((margin < 0).mean()), 6),
    }


def reference_table(store: PairStore, sidecar: Path) -> tuple[np.ndarray, np.ndarray, dict]:
    """The sidecar's chosen and rejected log-probs (float64, NaN where unscored) and its record, checked: made for
    `store`'s datasets, its table's bytes and sha256 as recorded, one value per pair."""
    from safetensors import SafetensorError
    from safetensors.numpy import load_file

    from dpo_state.files import file_problems
    from dpo_state.sidecar_record import read_sidecar_record

    record = read_sidecar_record(sidecar)
    if record["dataset"]["fingerprint"] != store.fingerprint:
        raise DataError(
            f"--reference {sidecar} was computed for dataset {record['dataset']['fingerprint']}, the audited "
            f"datasets are {store.fingerprint}; precompute it for these datasets (dpo-train CONFIG "
            "--precompute-reference with data.path set to them)"
        )
    table = sidecar / record["table"]["path"]
    problems = file_problems(table, record["table"]["bytes"], record["table"]["sha256"], str(table), "reference.json")
    if problems:
        raise DataError(f"--reference: {problems[0]}; precompute the sidecar again")
    try:
        tensors = load_file(str(table))
    except (SafetensorError, OSError) as e:
        raise DataError(f"--reference: {table} cannot be read ({e}); precompute the sidecar again") from None
    chosen, rejected = (np.asarray(tensors.get(k, []), np.float64) for k in ("chosen", "rejected"))
    if chosen.shape != (store.num_pairs,) or rejected.shape != (store.num_pairs,):
        raise DataError(
            f"--reference: {table} holds chosen {chosen.shape} and rejected {rejected.shape} log-probs for "
            f"{store.num_pairs} pairs; precompute the sidecar again"
        )
    return chosen, rejected, record
