"""`dpo-state inspect / diff / verify`: read checkpoints (and verify exports) without a process group or unpickling."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpo_state.commit import COMMIT_FILE, commit_problems, read_commit
from dpo_state.dcp_io import DCP_DIR, DCP_METADATA, read_dcp_metadata, reading_tensors, safe_reader
from dpo_state.errors import DocumentError, StateError
from dpo_state.export_record import export_problems, is_export, link_problems
from dpo_state.files import read_json
from dpo_state.layout import resolve
from dpo_state.state import (
    IDENTITY_PARTS,
    STATE_FILE,
    TREE_FILE,
    differences,
    rank_entry_problems,
    read_rank_state,
    read_state,
    read_state_tree,
)

_COPY_AGAIN = "put the files themselves there (cp -r --dereference), or copy the run again without links"


def inspect_checkpoint(path: str | Path) -> dict[str, Any]:
    """What a checkpoint holds, from its JSON files only (no tensor is read, nothing is unpickled)."""
    directory = resolve(path)
    committed = (directory / COMMIT_FILE).is_file()
    state = read_state(directory)
    files = read_commit(directory)["files"] if committed else []
    outside = rank_entry_problems(state)
    if outside:  # never display (or open) a file the checkpoint does not own
        raise StateError(f"{directory}: " + "; ".join(outside))
    ranks = []
    for entry in state["ranks"]:
        rank_file = directory / entry["state"]
        position = read_json(rank_file)["loader"]["position"] if rank_file.is_file() else None
        ranks.append({"rank": entry["rank"], "file": entry["state"], "loader_position": position})
    identity = state["identity"]
    return {
        "path": str(directory),
        "committed": committed,
        "format_version": state["format_version"],
        "step": state["step"],
        "epoch": state["epoch"],
        "consumed": state["consumed"],
        "files": len(files),
        "bytes": sum(f["bytes"] for f in files),
        "tensors": state["tensors"],
        "ranks": ranks,
        "config_sha256": state["config_sha256"],
        "identity": identity,
        "lineage": state["lineage"],
        "package": state["package"],
        "environment": state.get("environment"),
    }


def checkpoint_problems(directory: str | Path, hashes: bool = True) -> list[str]:
    """Every reason a checkpoint must not be read; empty = sound. The one verification that `dpo-state
    verify`, `diff`, resume and `weights_from` all use, so they never disagree.

    Checked: no symbolic link, the step directory itself included (its target may change after the check, and a
    copied run would verify against the bytes it points to); the files against the commit record (missing,
    resized, altered, outside, unlisted); state.json
    and state_tree.json (schema, version); the commit record's step against state.json's; the rank files
    (named as the format says, listed, parsed, each rank's loader position equal to the one state.json
    records); RNG files; and, last, DCP's metadata through the restricted unpickler (tensors only).
    `hashes=False` checks sizes but not sha256, RNG files or DCP's metadata (no torch import): for readers
    that open no tensor (`diff` without `--values`).
    """
    directory = Path(directory)
    problems = link_problems(directory, "the checkpoint", _COPY_AGAIN) + commit_problems(directory, hashes)
    try:
        record = read_commit(directory)
        state = read_state(directory)
    except DocumentError as e:
        return _unique(problems + [str(e)])
    if record["step"] != state["step"]:
        problems.append(f"{COMMIT_FILE} is for step {record['step']}, {STATE_FILE} for step {state['step']}")
    listed = {entry["path"] for entry in record["files"]}
    problems += [
        f"{name}: not in the commit record" for name in (STATE_FILE, TREE_FILE, DCP_METADATA) if name not in listed
    ]
    try:
        read_state_tree(directory)
    except DocumentError as e:
        problems.append(str(e))
    entries = rank_entry_problems(state)
    problems += entries
    if not entries:
        for entry in state["ranks"]:
            problems += _rank_file_problems(directory, entry, listed, hashes)
    if not problems and hashes:
        try:
            read_dcp_metadata(directory / DCP_DIR)
        except StateError as e:
            problems.append(str(e))
    return _unique(problems)


def _rank_file_problems(directory: Path, entry: dict, listed: set[str], rng: bool = True) -> list[str]:
    problems = [
        f"{name}: rank {entry['rank']}'s file is not in the commit record"
        for name in (entry["state"], entry["rng"])
        if name not in listed
    ]
    try:
        document = read_rank_state(directory / entry["state"])
        if document["loader"]["position"] != entry["position"]:
            problems.append(
                f"{entry['state']}: loader position {document['loader'].get('position')} differs from "
                f"the one {STATE_FILE} records for rank {entry['rank']} ({entry['position']})"
            )
    except DocumentError as e:
        problems.append(str(e))
    return problems + (_rng_problems(directory / entry["rng"]) if rng else [])


def _unique(problems: list[str]) -> list[str]:
    return sorted(set(problems), key=problems.index)


def verify_checkpoint(path: str | Path) -> list[str]:
    """`checkpoint_problems` of a step directory, or of a run directory's latest committed checkpoint; for an
    export (final/, final-merged/: a directory holding export.json, or model files that lost it), `export_problems`."""
    if is_export(path):
        return export_problems(path)
    try:
        directory = resolve(path)
    except StateError as e:
        return [str(e)]
    return checkpoint_problems(directory)


def _rng_problems(path: Path) -> list[str]:
    from safetensors import safe_open

    if not path.is_file():
        return [f"{path.name}: missing"]
    try:
        with safe_open(str(path), framework="pt") as f:
            if "cpu" not in f.keys():
                return [f"{path.name}: no 'cpu' RNG state"]
    except Exception as e:  # noqa: BLE001 - any parse failure of the header is a named problem
        return [f"{path.name}: not a readable safetensors file ({e})"]
    return []


def diff_checkpoints(a: str | Path, b: str | Path, values: bool = False, atol: float = 0.0) -> dict[str, Any]:
    """Differences between two checkpoints by section; with `values`, the largest absolute difference
    per tensor (reads the tensors: DCP metadata is hash-checked against each commit record first)."""
    da, db = resolve(a), resolve(b)
    for directory in (da, db):  # a checkpoint that does not verify has no trustworthy content to compare
        problems = checkpoint_problems(directory, hashes=values)  # sha256 only when tensors are read
        if problems:
            raise StateError(f"{directory} does not verify:\n  - " + "\n  - ".join(problems))
    sa, sb = read_state(da), read_state(db)
    sections: dict[str, list] = {}
    sections["config"] = _lines(
        differences(_without(sa["config"], "train.output_dir"), _without(sb["config"], "train.output_dir"))
    )
    for part in IDENTITY_PARTS:
        sections[part] = _lines(differences(sa["identity"][part], sb["identity"][part]))
    sections["positions"] = _lines(
        differences(
            {"step": sa["step"], "epoch": sa["epoch"], "loader": sa["loader"]["position"], "consumed": sa["consumed"]},
            {"step": sb["step"], "epoch": sb["epoch"], "loader": sb["loader"]["position"], "consumed": sb["consumed"]},
        )
    )
    sections["scheduler_state"] = _lines(differences(sa["scheduler_state"], sb["scheduler_state"]))
    sections["environment"] = _lines(differences(sa.get("environment", {}), sb.get("environment", {})))
    result: dict[str, Any] = {"a": str(da), "b": str(db), "sections": {k: v for k, v in sections.items() if v}}
    if values:
        result["tensors"] = _tensor_differences(da, db, atol)
    result["equal"] = not result["sections"] and not (values and result["tensors"]["differ"])
    return result


def _without(config: dict, dotted: str) -> dict:
    section, key = dotted.split(".")
    return {**config, section: {k: v for k, v in config.get(section, {}).items() if k != key}}


def _lines(diffs: list) -> list[dict]:
    return [{"path": p, "a": x, "b": y} for p, x, y in diffs]


def _tensor_differences(da: Path, db: Path, atol: float) -> dict[str, Any]:
    ta, tb = _load_tensors(da), _load_tensors(db)
    rows, differ = [], 0
    for key in sorted(set(ta) | set(tb)):
        if key not in ta or key not in tb:
            rows.append({"tensor": key, "max_abs_diff": None, "note": "only in " + ("a" if key in ta else "b")})
            differ += 1
            continue
        x, y = ta[key], tb[key]
        if x.shape != y.shape:
            rows.append({"tensor": key, "max_abs_diff": None, "note": f"shape {list(x.shape)} vs {list(y.shape)}"})
            differ += 1
            continue
        gap = float((x.double() - y.double()).abs().max()) if x.numel() else 0.0
        rows.append({"tensor": key, "max_abs_diff": gap})
        differ += gap > atol
    return {"count": len(rows), "differ": differ, "atol": atol, "per_tensor": rows}


def _load_tensors(directory: Path) -> dict[str, Any]:
    """Every tensor of a checkpoint's DCP state, flattened by name, on CPU, without a process group.
    Every file must match the commit record, and DCP's metadata is read by the restricted unpickler."""
    import torch
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict_from_keys

    with reading_tensors(directory / DCP_DIR):
        state = _load_state_dict_from_keys(storage_reader=safe_reader(directory / DCP_DIR))
    flat: dict[str, Any] = {}
    stack: list[tuple[str, Any]] = [("", state)]
    while stack:
        prefix, item = stack.pop()
        if isinstance(item, dict):
            stack += [(f"{prefix}.{k}" if prefix else str(k), v) for k, v in item.items()]
        elif isinstance(item, (list, tuple)):
            stack += [(f"{prefix}[{i}]", v) for i, v in enumerate(item)]
        elif torch.is_tensor(item):
            flat[prefix] = item
    return flat
