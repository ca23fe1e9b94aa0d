"""schemas/train-config.schema.json generated from the config's sections: each key's type from its annotation, its
default and its range, choices and shape from its field (`key(...)`); `python -m dpo_train.config.schema --write`."""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
import types
import typing
from dataclasses import MISSING, Field, fields
from pathlib import Path
from typing import Any

from dpo_train.config.sections import CONFIG_FORMAT_VERSION, LOSS_TYPES, SECTIONS
from dpo_train.keys import SCHEMA
from dpo_train.step.loss import Interval

COMMITTED = Path(__file__).resolve().parents[2] / "schemas" / "train-config.schema.json"
"""The committed schema, which `load_config` validates against (tests/train/config/test_config_schema.py keeps it
equal to `generate()`)."""

_HEAD = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://dpo-toolkit.invalid/schemas/train-config.schema.json",
    "title": "dpo-train config",
    "description": "The YAML config of dpo-train, and OUTPUT/config.resolved.yaml. See docs/train-config.md. "
    "Generated from dpo_train/config/sections.py: python -m dpo_train.config.schema --write",
    "type": "object",
    "additionalProperties": False,
}
_JSON_TYPES = {str: "string", bool: "boolean", int: "integer", float: "number", dict: "object", list: "array"}
_GIVES_TYPE = ("type", "enum", "const", "oneOf")
"""Keywords that say what a key may be by themselves: the annotation's type is then left out."""


@functools.cache
def generate() -> dict:
    """The config's JSON Schema, from `SECTIONS`."""
    properties = {"format_version": {"const": CONFIG_FORMAT_VERSION}}
    for name, cls in SECTIONS.items():
        hints = typing.get_type_hints(cls)
        keys = {f.name: _key(f, hints[f.name]) for f in fields(cls)}
        properties[name] = {"type": "object", "additionalProperties": False, "properties": keys}
    return {**_HEAD, "properties": properties, "$defs": {"loss_type": dict(LOSS_TYPES)}}


def _key(f: Field, hint: Any) -> dict:
    """One key's node: its JSON type (unless its keywords say what it may be), its keywords, its default."""
    stated = dict(f.metadata.get(SCHEMA, {}))
    node = {} if any(word in stated for word in _GIVES_TYPE) else {"type": _json_type(hint)}
    node.update({word: list(value) if isinstance(value, tuple) else value for word, value in stated.items()})
    default = f.default_factory() if f.default is MISSING else f.default
    description = node.pop("description", None)
    return {**node, "default": default, **({"description": description} if description else {})}


def _json_type(hint: Any) -> str | list[str]:
    """`int` -> "integer", `str | None` -> ["string", "null"], `list[float]` -> "array"."""
    members = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    names = ["null" if member is type(None) else _JSON_TYPES[typing.get_origin(member) or member] for member in members]
    return names[0] if len(names) == 1 else names


def node(path: str) -> dict:
    """The generated schema's node of a key: 'loss.beta', 'model.lora.r', 'optim.betas[]' (a list's items)."""
    here = generate()
    for part in path.split("."):
        items = part.endswith("[]")
        here = here["properties"][part.removesuffix("[]")]
        here = here["items"] if items else here
    return here


def interval(path: str) -> Interval:
    """A numeric key's range as its schema node states it ('loss.beta' -> (0, 1000])."""
    found = node(path)
    low, high = found.get("minimum", found.get("exclusiveMinimum", -math.inf)), found.get("maximum")
    high = found.get("exclusiveMaximum", math.inf) if high is None else high
    return Interval(low, high, open_high="exclusiveMaximum" in found, open_low="exclusiveMinimum" in found)


def choices(path: str) -> tuple:
    """A key's choices as its schema node states them ('train.report_to[]' -> ('tensorboard', 'wandb'))."""
    return tuple(node(path)["enum"])


def dumps(schema: dict) -> str:
    """The schema as committed: two-space JSON, each node on one line where that line fits in 120 characters."""
    return _dump(schema, 0, 0) + "\n"


def _dump(value: Any, indent: int, start: int) -> str:
    """`value` written from column `start` of a line indented by `indent`."""
    flat = json.dumps(value, ensure_ascii=False)
    if not isinstance(value, (dict, list)) or not value or start + len(flat) <= 120:
        return flat
    inner = " " * (indent + 2)
    if isinstance(value, list):
        items = [inner + _dump(item, indent + 2, indent + 2) for item in value]
    else:
        items = [
            f"{inner}{json.dumps(k)}: {_dump(v, indent + 2, indent + len(json.dumps(k)) + 4)}" for k, v in value.items()
        ]
    opened, closed = "[]" if isinstance(value, list) else "{}"
    return opened + "\n" + ",\n".join(items) + "\n" + " " * indent + closed


def main(argv: list[str] | None = None) -> int:
    """--write: rewrite the committed schema from the sections; --check (the default): exit 1 if it differs."""
    parser = argparse.ArgumentParser(prog="python -m dpo_train.config.schema", description=main.__doc__)
    parser.add_argument("--write", action="store_true", help=f"rewrite {COMMITTED.name} from the sections")
    args = parser.parse_args(argv)
    text = dumps(generate())
    if args.write:
        COMMITTED.write_text(text)
        print(f"wrote {COMMITTED}")
        return 0
    if COMMITTED.read_text() != text:
        print(
            f"{COMMITTED} is not the sections' schema: run python -m dpo_train.config.schema --write", file=sys.stderr
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
