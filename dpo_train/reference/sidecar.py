"""Precomputed reference log-probs: a sidecar bound to the dataset and the reference weights, verified before use."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import torch

from dpo_state.digest import DIGEST_PREFIX, file_digest
from dpo_state.errors import DocumentError
from dpo_state.files import file_problems, write_json_atomic
from dpo_state.sidecar_record import (  # the document's format; dpo_state owns it so that the report reads it too
    SIDECAR_DOCUMENT,
    SIDECAR_FORMAT_VERSION,
    SIDECAR_SCHEMA,
    SIDECAR_TABLE,
    read_sidecar_record,
)
from dpo_train.errors import SidecarError


def weights_fingerprint(model: Any) -> str:
    """sha256 over the parameters and buffers in name order: names, dtypes, shapes and raw bytes.

    Computed on the full (unsharded) module, so it identifies the reference weights whatever the
    strategy; it changes with any weight, dtype or shape.
    """
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        t = tensor.detach().cpu().contiguous()
        h.update(orjson.dumps([name, str(t.dtype), list(t.shape)]))
        h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")
    return DIGEST_PREFIX + h.hexdigest()


@dataclass
class ReferenceTable:
    """Reference log-probs by global pair index (sums over completion tokens)."""

    chosen: torch.Tensor
    rejected: torch.Tensor
    sha256: str = ""
    """The table file's sha256 (part of the run identity recorded in checkpoints)."""
    path: str = ""
    steps: int | None = None
    """A table of the first `steps` steps' pairs only (`--only-planned`); None: every pair."""

    def lookup(self, pair_index: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        index = pair_index.cpu().long()
        self._check_scored(index, "this micro-batch")
        return self.chosen[index].to(device, torch.float32), self.rejected[index].to(device, torch.float32)

    def check_covers(self, pairs: np.ndarray, steps: int) -> None:
        """Before the first step: refuse a table that lacks a pair the run's `steps` steps read (`pairs`)."""
        self._check_scored(torch.from_numpy(np.asarray(pairs, dtype=np.int64)), f"train.max_steps {steps} steps")

    def _check_scored(self, index: torch.Tensor, reader: str) -> None:
        """Fail closed on a pair the precompute never scored (NaN): never a loss against a missing value."""
        if self.steps is None:
            return
        missing = index[torch.isnan(self.chosen[index])]
        if len(missing):
            raise SidecarError(
                f"reference sidecar {self.path} holds only the pairs of the first {self.steps} steps of the run it "
                f"was precomputed for (--only-planned), and {reader} read {len(missing)} others (first: pair "
                f"{int(missing[0])}): another train.max_steps, data.seed, batch size or world size reads other pairs. "
                "Recompute it with `dpo-train CONFIG --precompute-reference --overwrite` (every pair), or with "
                "--only-planned for this config"
            )

    def check_initial(self, policy: Any, pair_index: torch.Tensor, precision: str) -> None:
        """Before the first optimizer step the policy holds the reference's weights (the sidecar is bound to
        their fingerprint), so its log-probs of this micro-batch's pairs must be the table's, up to the
        precision's noise and a different packing: an edited or swapped table whose hashes were rewritten
        is a SidecarError here, not a quietly wrong loss."""
        per_token, slack = _INITIAL_TOLERANCE[precision]
        index = pair_index.cpu().long()
        for side, table, got, tokens in (
            ("chosen", self.chosen, policy.chosen, policy.chosen_tokens),
            ("rejected", self.rejected, policy.rejected, policy.rejected_tokens),
        ):
            want, got, tokens = table[index], got.detach().double().cpu(), tokens.double().cpu()
            off = torch.nonzero((got - want).abs() > slack + per_token * tokens)[:, 0]
            if len(off):
                i = int(off[0])
                raise SidecarError(
                    f"reference sidecar {self.path}: before the first step the policy is the reference, yet pair "
                    f"{int(index[i])}'s {side} log-prob is {float(got[i]):.4f} and the table says {float(want[i]):.4f} "
                    f"({len(off)} of {len(index)} pairs of this micro-batch differ beyond the {precision} tolerance): "
                    "the table was not computed by these weights on this data. Recompute it with "
                    "`dpo-train CONFIG --precompute-reference --overwrite`"
                )


# (per completion token, absolute) nats a packed training forward may differ from the precompute's
_INITIAL_TOLERANCE = {"fp32": (1e-4, 1e-3), "bf16": (5e-2, 0.1)}


def write_sidecar(
    path: str | Path,
    scores,
    store,
    weights: str,
    precision: str,
    layout: str,
    model_source: str,
    seconds: float | None = None,
    steps: int | None = None,
) -> Path:
    """Write the table, then `reference.json` (by rename, last): a sidecar without it is not one. `seconds`:
    the precompute's wall time so far, recorded for the report of a run that uses the sidecar. `steps`: the
    table holds only the pairs of a run's first `steps` steps (the others NaN), recorded as its coverage."""
    from safetensors.numpy import save_file

    from dpo_data import __version__

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / SIDECAR_DOCUMENT).unlink(missing_ok=True)  # an old document must not vouch for a new table
    table = path / SIDECAR_TABLE
    save_file(
        {
            "chosen": scores.chosen,
            "rejected": scores.rejected,
            "chosen_tokens": scores.chosen_tokens,
            "rejected_tokens": scores.rejected_tokens,
        },
        str(table),
    )
    held = int(_held(scores.chosen, scores.rejected).sum())
    document = {
        "format_version": SIDECAR_FORMAT_VERSION,
        "dataset": {
            "fingerprint": store.fingerprint,
            "datasets": store.dataset_fingerprints,
            "num_pairs": store.num_pairs,
        },
        "reference": {
            "weights_fingerprint": weights,
            "source": model_source,
            "precision": precision,
            "layout": layout,  # log-probs of two layouts agree to about 1e-6, not bitwise: bound like precision
        },
        "table": {"path": SIDECAR_TABLE, "bytes": table.stat().st_size, "sha256": file_digest(table)},
        "producer": {"name": "dpo-toolkit", "version": __version__},
        **({} if seconds is None else {"seconds": round(seconds, 3)}),
        **({} if steps is None else {"coverage": {"steps": steps, "pairs": held}}),
    }
    write_json_atomic(path / SIDECAR_DOCUMENT, document, schema=SIDECAR_SCHEMA)
    return path


def load_sidecar(path: str | Path, store, weights: str, precision: str, layout: str) -> ReferenceTable:
    """Verify a sidecar against this run (dataset, weights, precision, layout, hashes) and load its table.

    Every mismatch is listed in one error with the command that recomputes the sidecar.
    """
    path = Path(path)
    document = _read_document(path)
    problems = _binding_problems(document, store, weights, precision, layout)
    table = path / SIDECAR_TABLE
    if not problems:
        spec = document["table"]
        problems = file_problems(table, spec["bytes"], spec["sha256"], str(table), SIDECAR_DOCUMENT)
    if problems:
        raise SidecarError(_message(path, problems))
    from safetensors.numpy import load_file

    arrays = load_file(str(table))
    n = store.num_pairs
    if any(arrays[k].shape != (n,) for k in ("chosen", "rejected")):
        raise SidecarError(_message(path, [f"the table does not hold {n} pairs"]))
    coverage = document.get("coverage")
    scored = _scored(arrays, coverage)
    problems = [p for k in ("chosen", "rejected") if (p := _impossible(arrays[k][scored], k, np.flatnonzero(scored)))]
    if problems:
        raise SidecarError(_message(path, problems))
    return ReferenceTable(
        torch.from_numpy(np.asarray(arrays["chosen"], dtype=np.float64)),
        torch.from_numpy(np.asarray(arrays["rejected"], dtype=np.float64)),
        document["table"]["sha256"],
        str(path),
        None if coverage is None else coverage["steps"],
    )


def _scored(arrays: dict, coverage: dict | None) -> np.ndarray:
    """The pairs the table holds values for: every pair, or under a `coverage` the entries not NaN on both
    sides, exactly as many as it records; anything else is checked (and refused) as a value like any other."""
    every = np.ones(len(arrays["chosen"]), dtype=bool)
    if coverage is None:
        return every
    scored = _held(arrays["chosen"], arrays["rejected"])
    return scored if int(scored.sum()) == coverage["pairs"] else every


def _held(chosen: np.ndarray, rejected: np.ndarray) -> np.ndarray:
    """Pairs with a value on either side: a gap (a pair never scored) is NaN on both."""
    return ~(np.isnan(chosen) & np.isnan(rejected))


def _impossible(values: np.ndarray, side: str, pairs: np.ndarray) -> str | None:
    """A summed log-probability is finite and at most 0; anything else was never computed by a model
    (hashes beside the table prove only that nobody changed it since they were written). `pairs`: the
    global index of each of `values`."""
    bad = np.flatnonzero(~np.isfinite(values) | (values > 0))
    if not len(bad):
        return None
    shown = ", ".join(f"pair {int(pairs[i])}: {float(values[i])}" for i in bad[:3])
    return f"{side} log-probs must be finite and <= 0; {len(bad)} are not ({shown}{', ...' if len(bad) > 3 else ''})"


def _read_document(path: Path) -> Any:
    doc = path / SIDECAR_DOCUMENT
    if not doc.is_file():
        raise SidecarError(_message(path, [f"{doc} does not exist (no sidecar, or one never finished)"]))
    try:
        return read_sidecar_record(path)
    except DocumentError as e:
        raise SidecarError(_message(path, [str(e)])) from None


def _binding_problems(document: dict, store, weights: str, precision: str, layout: str) -> list[str]:
    problems = []
    data, ref = document["dataset"], document["reference"]
    if data["fingerprint"] != store.fingerprint:
        problems.append(
            f"dataset: the sidecar was computed for {data['fingerprint']}, data.path is {store.fingerprint}"
        )
    if data["num_pairs"] != store.num_pairs:
        problems.append(f"dataset: the sidecar holds {data['num_pairs']} pairs, data.path has {store.num_pairs}")
    if ref["weights_fingerprint"] != weights:
        problems.append(
            f"reference weights: the sidecar was computed with {ref['weights_fingerprint']} "
            f"({ref['source']}), the model is {weights}"
        )
    if ref["precision"] != precision:
        problems.append(f"precision: the sidecar was computed in {ref['precision']}, this run uses {precision}")
    if ref.get("layout", "separate") != layout:  # sidecars before the layout was recorded packed separately
        problems.append(
            f"layout: the sidecar was computed in the {ref.get('layout', 'separate')} layout, data.layout is {layout}"
        )
    return problems


def _message(path: Path, problems: list[str]) -> str:
    return (
        f"reference sidecar {path} cannot be used:\n  - "
        + "\n  - ".join(problems)
        + "\n  fix: recompute it with `dpo-train CONFIG --precompute-reference`"
    )
