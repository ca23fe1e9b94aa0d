"""Loading a config: YAML (or a mapping) -> `--set` overrides -> unknown keys named -> schema -> typed
sections -> rules."""

from __future__ import annotations

import difflib
import re
from dataclasses import fields
from pathlib import Path
from typing import Any

from dpo_state.schema import load_schema, schema_problems
from dpo_train.config.overrides import apply_override
from dpo_train.config.rules import check_config
from dpo_train.config.sections import (
    CONFIG_FORMAT_VERSION,
    CONFIG_SCHEMA,
    SECTIONS,
    TrainConfig,
)
from dpo_train.config.strict_yaml import non_finite, read_yaml_file
from dpo_train.config.trl_table import hint
from dpo_train.errors import ConfigError

INT64 = (-(2**63), 2**63 - 1)
"""Every integer of a config fits here (orjson writes the run identity; torch and numpy take 64-bit seeds)."""


def load_config(source: str | Path | dict, overrides: list[str] = ()) -> TrainConfig:
    """Read a YAML file (or a mapping), apply `key.sub=value` overrides (values parsed as YAML), check
    for unknown keys, validate against schemas/train-config.schema.json, build typed sections, and check
    them together (`check_config` with for_run=False: a config without data.path loads)."""
    raw = _read(source)
    for item in overrides:
        apply_override(raw, item)
    version = raw.pop("format_version", CONFIG_FORMAT_VERSION)
    if version != CONFIG_FORMAT_VERSION:
        raise ConfigError(
            f"format_version is {version!r}; this dpo-train reads config format_version "
            f"{CONFIG_FORMAT_VERSION}: drop the key, or use the version the config was written for"
        )
    _check_keys(raw)
    bad = non_finite(raw)
    if bad:
        raise ConfigError(
            f"{', '.join(bad)}: not a finite number (NaN or infinity); every number in a config "
            "must be finite and inside the key's range (docs/train-config.md)"
        )
    schema = load_schema(CONFIG_SCHEMA)
    raw, problems = _integers(schema, raw, "")
    if problems:
        raise ConfigError(
            "the config has integers beyond 64 bits; write each inside the range:\n  - " + "\n  - ".join(problems)
        )
    problems = schema_problems(CONFIG_SCHEMA, {"format_version": CONFIG_FORMAT_VERSION, **raw})
    if problems:
        raise ConfigError(
            "the config does not match schemas/train-config.schema.json:\n  - "
            + "\n  - ".join(_with_range(schema, p) for p in problems)
        )
    config = TrainConfig(**{name: cls(**raw.get(name, {})) for name, cls in SECTIONS.items()})
    check_config(config, for_run=False)
    return config


def _read(source: str | Path | dict) -> dict:
    if isinstance(source, dict):
        return {k: dict(v) if isinstance(v, dict) else v for k, v in source.items()}
    path = Path(source)
    raw = read_yaml_file(path) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {path} must hold a mapping of sections, got {type(raw).__name__}")
    return raw


def _check_keys(raw: dict) -> None:
    problems = []
    for section, value in raw.items():
        if section not in SECTIONS:
            problems.append(f"unknown section {section!r}{suggest(section, SECTIONS)}")
            continue
        if not isinstance(value, dict):
            problems.append(f"section {section!r} must be a mapping, got {value!r:.60}")
            continue
        known = [f.name for f in fields(SECTIONS[section])]
        for key in value:
            if key not in known:
                problems.append(f"unknown key {section}.{key}{suggest(key, known)}; known keys: {', '.join(known)}")
    if problems:
        raise ConfigError(
            "the config has unknown keys or sections that are not mappings:\n  - " + "\n  - ".join(problems)
        )


def _integers(node: dict, value: Any, path: str) -> tuple[Any, list[str]]:
    """`value` with each integral float of an integer key made an int (YAML reads 1e6 as a float), and a
    line for each integer beyond 64 bits where the schema sets no range (a free mapping such as
    model.init.config): the run identity is written by orjson, which takes 64 bits."""
    if isinstance(value, dict):
        pairs = [
            (k, _integers(_child(node, "properties", k), v, f"{path}.{k}" if path else str(k)))
            for k, v in value.items()
        ]
        return {k: v for k, (v, _) in pairs}, [p for _, (_, problems) in pairs for p in problems]
    if isinstance(value, list):
        items = [_integers(_child(node, "items"), v, f"{path}[{i}]") for i, v in enumerate(value)]
        return [v for v, _ in items], [p for _, problems in items for p in problems]
    integer = "integer" in _types(node)
    if integer and isinstance(value, float) and value.is_integer() and INT64[0] <= value <= INT64[1]:
        return int(value), []
    unbounded = not any(key in node for key in _BOUNDS)  # a bounded key's range is the schema's to report
    if isinstance(value, int) and not isinstance(value, bool) and not INT64[0] <= value <= INT64[1] and unbounded:
        return value, [f"{path} is {value}; an integer in a config must lie in [{INT64[0]:_}, {INT64[1]:_}]"]
    return value, []


def _child(node: dict, kind: str, key: Any = None) -> dict:
    """The schema node of a mapping's key or of a list's items; {} where the schema leaves them free."""
    child = node.get(kind, {})
    return child.get(key, {}) if kind == "properties" else child


def _types(node: dict) -> list[str]:
    types = node.get("type", [])
    return [types] if isinstance(types, str) else types


def _with_range(schema: dict, problem: str) -> str:
    """A schema problem of a bounded key (out of range, of another type, or a word it does not take), also naming
    everything the key allows."""
    path, _, _ = problem.partition(": ")
    node = schema
    for part in path.split("/"):
        node = node.get("items", {}) if part.isdigit() else node.get("properties", {}).get(part, {})
    if not any(key in node for key in _BOUNDS):
        return problem
    return f'{problem}; allowed: {_allowed(node)} (docs/train-config.md, "Bounds")'


_BOUNDS = ("minimum", "exclusiveMinimum", "maximum", "exclusiveMaximum")
_WORD = re.compile(r"\^(\w+)\$")
"""A pattern that admits one word (`^auto$`): a bounded key's word besides its numbers."""


def _allowed(node: dict) -> str:
    """What a bounded node admits: its interval ('an integer in [1, 1_000_000]', 'a number in (0, 100]'), then the
    word its pattern names and null, where it takes them."""
    low = _end(node, "minimum", "[") or _end(node, "exclusiveMinimum", "(") or "(-inf"
    high = _end(node, "maximum", "]") or _end(node, "exclusiveMaximum", ")") or "inf)"
    options = [f"{'an integer' if 'integer' in _types(node) else 'a number'} in {low}, {high}"]
    word = _WORD.fullmatch(node.get("pattern", ""))
    options += [word.group(1)] if word and "string" in _types(node) else []
    options += ["null"] if "null" in _types(node) else []
    return options[0] if len(options) == 1 else ", ".join(options[:-1]) + " or " + options[-1]


def _end(node: dict, key: str, bracket: str) -> str | None:
    """One end of the interval; integers with _ between thousands, as YAML also reads them."""
    if key not in node:
        return None
    value = node[key]
    text = f"{value:_}" if isinstance(value, int) else repr(value)
    return bracket + text if bracket in "[(" else text + bracket


def suggest(name: str, choices) -> str:
    trl = hint(name)
    if trl:
        return f" ({trl})"
    close = difflib.get_close_matches(name, list(choices), n=1)
    return f" (did you mean {close[0]!r}?)" if close else ""
