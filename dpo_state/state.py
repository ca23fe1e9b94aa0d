"""The global checkpoint state (state.json): what a run was, where it stood, and the identity checks on resume."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import orjson

from dpo_state.files import read_document

CHECKPOINT_FORMAT_VERSION = 3
"""2: DCP holds tensors only; the non-tensor model and optimizer state is JSON (`TREE_FILE`).
3: the identity records the device kind (and the LoRA settings); RNG states are kept per device kind."""
STATE_SCHEMA = "checkpoint-state"
STATE_FILE = "state.json"
TREE_FILE = "state_tree.json"
"""The structure of the model and optimizer state with every non-tensor value (lr, betas, ...) as JSON;
`{"$tensor": true}` marks where DCP holds a tensor."""
TREE_SCHEMA = "checkpoint-state-tree"
TREE_FORMAT_VERSION = 1
IDENTITY_PARTS = ("dataset", "tokenizer", "reference", "objective", "optimizer", "model", "scheduler", "layout")
ELASTIC_KEYS = (
    "world_size",
    "rank",
    "strategy",
    "max_tokens_per_microbatch",
    "num_workers",
    "layout",
    "sequence_parallel.ulysses",
    "sequence_parallel.context",
)
"""What may change on resume in `pairs` batching, at a step boundary: the pairs of a step do not
depend on these, so the loader re-deals the same steps (a sequence-parallel group shares its rows, so
its sizes only change how a row is split; the layout only changes how a pair is packed). The loader's
geometry and the run's layout identity both use this one list."""
ROUNDING_KEYS = ("logits_budget_mib", "mlp_tile_tokens")
"""What may change on resume in either batching: it changes how a micro-batch's sums are rounded (the vocabulary
head whole or in chunks, the MLP whole or in tiles), never which pairs a step holds."""


RANK_SCHEMA = "checkpoint-rank"
RANK_FORMAT_VERSION = 1


def read_rank_state(path: str | Path) -> dict:
    """A rank's JSON file: schema-checked, and its loader state checked against schemas/loader-state."""
    from dpo_state.errors import DocumentError
    from dpo_state.schema import schema_problems

    document = read_document(path, RANK_SCHEMA, RANK_FORMAT_VERSION)
    problems = schema_problems("loader-state", document["loader"])
    if problems:
        raise DocumentError(
            f"{path}: its loader state does not match schemas/loader-state.schema.json:\n  - " + "\n  - ".join(problems)
        )
    return document


def rank_files(rank: int) -> tuple[str, str]:
    """A rank's two files in a checkpoint: its JSON state (loader) and its RNG states."""
    return f"rank-{rank:05d}.json", f"rank-{rank:05d}.rng.safetensors"


def rank_entry_problems(state: dict) -> list[str]:
    """state.json names rank 0..N-1, each with exactly its own two files: a path anywhere else (`../x`,
    an absolute path, another rank's file) is refused before any of them is opened."""
    problems = []
    for position, entry in enumerate(state["ranks"]):
        if entry["rank"] != position:
            problems.append(f"state.json: rank entry {position} is for rank {entry['rank']}; ranks run 0..N-1 in order")
        expected = rank_files(position)
        for name, want in zip((entry["state"], entry["rng"]), expected):
            if name != want:
                problems.append(
                    f"state.json: rank {entry['rank']} names the file {name!r}, not {want!r} "
                    "(a path outside the checkpoint, or another rank's file)"
                )
    return problems


def read_state(directory: str | Path) -> dict:
    """state.json of a checkpoint, schema-checked, format version checked."""
    return read_document(Path(directory) / STATE_FILE, STATE_SCHEMA, CHECKPOINT_FORMAT_VERSION)


def read_state_tree(directory: str | Path) -> dict:
    """state_tree.json of a checkpoint, schema-checked, format version checked."""
    return read_document(Path(directory) / TREE_FILE, TREE_SCHEMA, TREE_FORMAT_VERSION)


def normalized(value: Any) -> Any:
    """The JSON form of a value (tuples become lists), so saved and live identities compare equal."""
    return orjson.loads(orjson.dumps(value))


def differences(a: Any, b: Any, path: str = "") -> list[tuple[str, Any, Any]]:
    """(path, a value, b value) for every leaf that differs between two JSON values."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for key in sorted(set(a) | set(b), key=str):
            out += differences(a.get(key, "<absent>"), b.get(key, "<absent>"), f"{path}.{key}" if path else str(key))
        return out
    if isinstance(a, list) and isinstance(b, list) and len(a) == len(b):
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            out += differences(x, y, f"{path}[{i}]")
        return out
    return [] if a == b else [(path, a, b)]


def identity_mismatches(saved: dict, current: dict) -> tuple[list[str], list[str]]:
    """Compare a checkpoint's identity with the run's. Returns (mismatches, elastic changes): layout keys
    in ELASTIC_KEYS may differ when both use `pairs` batching, those in ROUNDING_KEYS in either; anything else
    is a mismatch."""
    saved, current = normalized(saved), normalized(current)
    elastic_ok = saved.get("layout", {}).get("batching") == "pairs" == current.get("layout", {}).get("batching")
    mismatches, elastic = [], []
    for part in IDENTITY_PARTS:
        for path, was, now in differences(saved.get(part), current.get(part), part):
            line = f"{path}: checkpoint {_short(was)}, this run {_short(now)}"
            key = path.split(".", 1)[1] if "." in path else ""
            allowed = key in ROUNDING_KEYS or (elastic_ok and key in ELASTIC_KEYS)
            (elastic if part == "layout" and allowed else mismatches).append(line)
    return mismatches, elastic


def _short(value: Any) -> str:
    text = orjson.dumps(value).decode() if not isinstance(value, str) else value
    return text if len(text) <= 120 else text[:117] + "..."
