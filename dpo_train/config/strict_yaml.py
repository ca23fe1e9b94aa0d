"""YAML for configs: the one strict reader (dpo_state/strict_yaml.py), its errors raised as ConfigError."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpo_state import strict_yaml
from dpo_state.strict_yaml import MAX_YAML_BYTES as MAX_CONFIG_BYTES
from dpo_state.strict_yaml import non_finite
from dpo_train.errors import ConfigError

__all__ = ["MAX_CONFIG_BYTES", "non_finite", "parse_yaml", "read_yaml_file"]


def parse_yaml(text: str, what: str) -> Any:
    """Parse `text` (named `what` in errors) strictly; every problem is a ConfigError."""
    return strict_yaml.parse_yaml(text, what, ConfigError)


def read_yaml_file(path: Path) -> Any:
    """A config file's YAML: a directory, a missing file, binary or oversized content are ConfigErrors."""
    return strict_yaml.read_yaml_file(path, ConfigError)
