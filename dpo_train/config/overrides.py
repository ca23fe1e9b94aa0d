"""`--set section.key=value`: one override applied to a config's sections as written, its value read as YAML."""

from __future__ import annotations

from dpo_train.config.strict_yaml import parse_yaml
from dpo_train.errors import ConfigError


def apply_override(raw: dict, item: str) -> None:
    """Set `item`'s key in `raw` (sections as written); imports no torch, so the CLI applies it before anything
    loads."""
    key, sep, value = item.partition("=")
    parts = key.strip().split(".")
    if not sep or len(parts) != 2 or not all(parts):
        raise ConfigError(f"--set {item!r}: write section.key=value, e.g. --set optim.lr=2e-5")
    section, name = parts
    target = raw.setdefault(section, {})
    if not isinstance(target, dict):
        raise ConfigError(f"--set {item!r}: {section} is not a section")
    target[name] = parse_yaml(value, f"--set {item!r}: the value")
