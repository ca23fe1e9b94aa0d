"""The one YAML reader of every command: bounded size, no anchors or aliases, no duplicate keys, named errors."""

from __future__ import annotations

import math
import re
from collections.abc import Hashable
from pathlib import Path
from typing import Any

import yaml

from dpo_state.errors import DocumentError, ToolkitError

MAX_YAML_BYTES = 1 << 20  # the YAML files read are configs, a few KB; anything near this is not one
MAX_YAML_DEPTH = 32  # a config nests a few levels; `[[[[...` 100k deep would exhaust Python's recursion limit


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses anchors and aliases (an alias bomb expands without bound), duplicate keys
    (YAML keeps the last silently), keys that are lists or mappings, and nesting deeper than
    MAX_YAML_DEPTH. YAML 1.1 reads 1e-5 (no dot) as a string; learning rates are written that way, so it
    is read as a float. Errors are raised as `self.error`, naming `self.what`."""

    error: type[ToolkitError] = DocumentError
    what = "the YAML"
    depth = 0

    def compose_node(self, parent: Any, index: Any) -> Any:
        event = self.peek_event()
        if isinstance(event, yaml.AliasEvent) or getattr(event, "anchor", None):
            kind = "alias *" if isinstance(event, yaml.AliasEvent) else "anchor &"
            raise self.error(
                f"{self.what}, line {event.start_mark.line + 1}: the {kind}{event.anchor} is not allowed in a config "
                "(anchors and aliases can expand without bound); write the values out"
            )
        if self.depth >= MAX_YAML_DEPTH:
            raise self.error(
                f"{self.what}, line {event.start_mark.line + 1}: values nested more than {MAX_YAML_DEPTH} levels deep; "
                "a config nests a few: flatten it"
            )
        self.depth += 1
        try:
            return super().compose_node(parent, index)
        finally:
            self.depth -= 1

    def construct_mapping(self, node: Any, deep: bool = False) -> dict:
        seen: dict[Any, int] = {}
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            if not isinstance(key, Hashable):  # `? [a, b]` would be a TypeError below
                raise self.error(
                    f"{self.what}, line {line}: a key that is a {type(key).__name__} is not allowed in a config; "
                    "keys are names: write the key as plain text"
                )
            if key in seen:
                raise self.error(
                    f"{self.what}, line {line}: the key {key!r} appears twice in one mapping (first on line "
                    f"{seen[key]}); YAML would keep the last silently: keep one"
                )
            seen[key] = line
        return super().construct_mapping(node, deep)


_StrictLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*)(?:\.[0-9_]*)?[eE][-+]?[0-9]+$"),
    list("-+0123456789"),
)


def parse_yaml(text: str, what: str, error: type[ToolkitError] = DocumentError) -> Any:
    """Parse `text` (named `what` in errors) with the strict loader; every problem is an `error`."""
    if len(text.encode("utf-8", "surrogatepass")) > MAX_YAML_BYTES:
        raise error(f"{what} is over {MAX_YAML_BYTES} bytes; a config is a few KB")
    loader = _StrictLoader(text)
    loader.error, loader.what = error, what
    try:
        return loader.get_single_data()
    except yaml.YAMLError as e:
        raise error(f"{what} is not valid YAML: {e}") from None
    finally:
        loader.dispose()


def read_yaml_file(path: Path, error: type[ToolkitError] = DocumentError) -> Any:
    """A config file's YAML: a directory, a missing file, binary or oversized content are named errors."""
    if path.is_dir():
        raise error(f"config file {path} is a directory; pass a YAML file")
    if path.exists() and not path.is_file():
        raise error(f"config file {path} is not a regular file (a device, a pipe or a socket); pass a YAML file")
    if not path.is_file():
        raise error(f"config file {path} does not exist; pass a YAML file")
    size = path.stat().st_size
    if size > MAX_YAML_BYTES:
        raise error(f"config file {path} is {size} bytes, over {MAX_YAML_BYTES}; a config is a few KB")
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(f"config file {path} is not UTF-8 text (byte {e.start}); pass a YAML file") from None
    if "\x00" in text:
        raise error(f"config file {path} holds NUL bytes: a binary file, not YAML")
    return parse_yaml(text, f"config file {path}", error)


def non_finite(value: Any, path: str = "") -> list[str]:
    """Dotted paths of every NaN or infinite number in a parsed config."""
    if isinstance(value, float) and not math.isfinite(value):
        return [path or "(root)"]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in non_finite(v, f"{path}.{k}" if path else str(k))]
    if isinstance(value, list):
        return [p for i, v in enumerate(value) for p in non_finite(v, f"{path}[{i}]")]
    return []
