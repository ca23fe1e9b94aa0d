"""Load JSON Schemas from `schemas/` and validate persisted documents against them, naming every error."""

from __future__ import annotations

import functools
from importlib import resources
from typing import Any

import jsonschema
import orjson

from dpo_state.errors import SchemaError


@functools.cache
def load_schema(name: str) -> dict:
    """The schema `schemas/<name>.schema.json`, parsed once per process."""
    text = resources.files("dpo_schemas").joinpath(f"{name}.schema.json").read_bytes()
    schema = orjson.loads(text)
    jsonschema.Draft202012Validator.check_schema(schema)
    return schema


@functools.cache
def _validator(name: str) -> jsonschema.Draft202012Validator:
    return jsonschema.Draft202012Validator(load_schema(name))


def schema_problems(name: str, document: Any) -> list[str]:
    """Every violation of schema `name` by `document`, as 'path: message' lines (empty when valid)."""
    errors = sorted(_validator(name).iter_errors(document), key=lambda e: list(map(str, e.absolute_path)))
    return [f"{'/'.join(map(str, e.absolute_path)) or '(root)'}: {e.message}" for e in errors]


def validate(name: str, document: Any, what: str | None = None) -> None:
    """Raise `SchemaError` naming every violation of schema `name` by `document`."""
    problems = schema_problems(name, document)
    if problems:
        raise SchemaError(what or name, problems)
