"""A package facade whose public names are imported on first use (PEP 562), so importing the package stays cheap."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_exports(package: str, namespace: dict, public: dict[str, str]) -> tuple[Callable, Callable]:
    """(`__getattr__`, `__dir__`) for `package`: each name in `public` (name -> module) is imported on
    first access and cached in the package's `namespace`; anything else is an AttributeError."""

    def __getattr__(name: str) -> Any:
        module = public.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(module), name)
        namespace[name] = value  # later lookups skip this function
        return value

    def __dir__() -> list[str]:
        return sorted(namespace.get("__all__", public))

    return __getattr__, __dir__
