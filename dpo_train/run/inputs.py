"""The directories a run reads (data.path, eval.path, a precomputed reference's sidecar) exist: named before
torch, a tokenizer or a model loads, and before anything is written."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from pathlib import Path

from dpo_train.errors import ConfigError

_FIX = {
    "data.path": "set data.path to a directory written by `dpo-data build` (its --out), or build it there",
    "eval.path": "set eval.path to a held-out dataset written by `dpo-data build`, or drop eval.path",
    "reference.path": "set reference.path to the sidecar, or create it there with `dpo-train CONFIG "
    "--precompute-reference`",
}


def check_inputs(sections: Mapping, precompute: bool = False) -> None:
    """Refuse, in one ConfigError naming each, an input directory that does not exist or is a file. `sections`:
    a config as written (`--set` applied) or `TrainConfig.resolved()`; a value of another type is the schema's to
    name. `precompute`: the run writes reference.path and reads neither eval.path nor a sidecar."""
    problems = [problem for key, path in input_paths(sections, precompute) if (problem := _problem(key, path))]
    if len(problems) > 1:
        raise ConfigError("the config names inputs that are not directories:\n  - " + "\n  - ".join(problems))
    if problems:
        raise ConfigError(problems[0])


def input_paths(sections: Mapping, precompute: bool = False) -> list[tuple[str, str]]:
    """(config key, directory) of every input the run reads, as written."""
    data = _section(sections, "data").get("path")
    named = [("data.path", path) for path in (data if isinstance(data, list) else [data])]
    if not precompute:
        named.append(("eval.path", _section(sections, "eval").get("path")))
        reference = _section(sections, "reference")
        if reference.get("mode") == "precomputed":
            named.append(("reference.path", reference.get("path")))
    return [(key, path) for key, path in named if isinstance(path, str) and path]


def _section(sections: Mapping, name: str) -> Mapping:
    value = sections.get(name)
    return value if isinstance(value, Mapping) else {}


def _problem(key: str, path: str) -> str | None:
    """What is wrong with one input directory, or None when it is one (whether it holds what it should is the
    reader's to say: a directory without manifest.json keeps its own message)."""
    where = Path(path)
    try:
        if where.is_dir():
            return None
        exists = where.exists()
    except (OSError, ValueError) as e:  # a NUL byte, a name too long: not a path this machine can open
        return f"{key} {path!r}: not a usable path ({e}); {_FIX[key]}"
    relative = "" if where.is_absolute() else f" (relative to the working directory {Path.cwd()})"
    what = "is a file, not a directory" if exists else "no such directory"
    return f"{key} {path}: {what}{relative}; {_did_you_mean(where)}fix: {_FIX[key]}"


def _did_you_mean(where: Path) -> str:
    """The closest sibling directory's name, where the parent can be listed and one is close."""
    try:
        siblings = [p.name for p in where.parent.iterdir() if p.is_dir()]
    except OSError:
        return ""
    close = difflib.get_close_matches(where.name, siblings, n=1)
    return f"did you mean {str(where.parent / close[0])!r}? " if close else ""
