"""A room's front door: the names the top floor uses, each imported from its module on first use (PEP 562)."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def front(room: str, modules: dict[str, tuple[str, ...]]) -> tuple[list[str], Callable[[str], Any]]:
    """`__all__` and `__getattr__` for the room package `room`: `modules` maps each module of the room to the
    names it lends the front door. Lazy, so that importing one module of a room (the CLI's `model.bundled` or
    `export.hub`) does not import the rest of it (torch, transformers)."""
    where = {name: module for module, names in modules.items() for name in names}

    def __getattr__(name: str) -> Any:
        if name not in where:
            raise AttributeError(f"module {room!r} has no attribute {name!r}")
        return getattr(importlib.import_module(f"{room}.{where[name]}"), name)

    return sorted(where), __getattr__
