"""A config key stated once: its default and its JSON Schema facts (range, choices, shape) on its dataclass field."""

from __future__ import annotations

from dataclasses import MISSING, field
from typing import Any

SCHEMA = "schema"
"""The field metadata entry holding the key's JSON Schema keywords (dpo_train/config/schema.py reads it)."""


def key(default: Any = MISSING, *, factory: Any = MISSING, **schema: Any) -> Any:
    """A section's field: its default (or `factory` for a mutable one) and the JSON Schema keywords that bound it,
    written as JSON Schema spells them (`minimum=0, maximum=1`, `enum=(...)`, `exclusiveMinimum=0`). The key's JSON
    type comes from the field's annotation unless `schema` gives `type`, `enum`, `const` or `oneOf`
    (`python -m dpo_train.config.schema --write` rewrites schemas/train-config.schema.json from these)."""
    return field(default=default, default_factory=factory, metadata={SCHEMA: schema})


WEIGHTS = {"items": {"type": "number", "minimum": 0, "maximum": 1000}}
"""A list of weights >= 0 (data.weights, loss.weights)."""

INT64_MAX = 2**63 - 1
"""The largest seed: torch and numpy take 64-bit seeds (numpy refuses negative ones)."""
