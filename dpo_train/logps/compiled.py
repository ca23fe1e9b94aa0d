"""A function compiled by torch.compile where that pays (CUDA), and checked against its eager self on first use."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch

from dpo_data.progress import say

TOLERANCE = 1e-5
"""Largest relative difference (to the eager output's largest magnitude) the compiled form's first result may
have: a fused kernel sums in another order (about 1e-7 in float32), a miscompiled one is off by far more."""

SHAPES = 2
"""Input shapes checked per device type: torch.compile builds one graph for the first shape and one with
dynamic sizes when a second comes (a run's last chunk is shorter), and reuses that one for every other size."""


def compiles_on(mode: bool | str, device_type: str) -> bool:
    """Whether train.compiled_head `mode` (auto, true or false) compiles on this device type."""
    return mode is True or (mode == "auto" and device_type == "cuda")


class Checked:
    """`fn` (tensors in, a tuple of tensors out), compiled on the devices `compiles_on` names for the mode each call
    is given (train.compiled_head, from `Scoring`). On each device type
    the first calls of its first SHAPES input shapes run both forms and compare them; a compiled form that fails
    to build or run, or differs by more than TOLERANCE, is dropped for the process, with one note, and the eager
    one runs from then on. So a backend without a compiler, or a miscompile, costs speed, never a wrong number."""

    def __init__(self, fn: Callable[..., tuple[torch.Tensor, ...]], name: str, compile_fn: Callable | None = None):
        self.fn, self.name = fn, name
        self._compile = compile_fn or (lambda f: torch.compile(f, fullgraph=True))  # one fused graph, or none
        self._compiled: Callable | None = None
        self._shapes: dict[str, set[tuple]] = {}
        self.state: dict[str, str] = {}
        """device type -> `checked` (the compiled form runs) or `eager` (dropped: why is in `self.why`)."""
        self.why: dict[str, str] = {}

    def __call__(self, mode: bool | str, *args: Any) -> tuple[torch.Tensor, ...]:
        device = next(a.device.type for a in args if isinstance(a, torch.Tensor))
        if not compiles_on(mode, device) or self.state.get(device) == "eager":
            return self.fn(*args)
        shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
        checked = self._shapes.setdefault(device, set())
        if shapes in checked or len(checked) >= SHAPES:
            try:
                return self.compiled(*args)
            except Exception as e:  # noqa: BLE001 - a later build (a new shape) that fails: the eager form
                return self._drop(device, _failed(e), self.fn(*args))
        eager = self.fn(*args)
        try:
            got = self.compiled(*args)
        except Exception as e:  # noqa: BLE001 - any failure to build or run it: the eager form stands in
            return self._drop(device, _failed(e), eager)
        error = max((_relative(a, b) for a, b in zip(got, eager)), default=0.0)
        if len(got) != len(eager) or not error <= TOLERANCE:  # NaN too
            return self._drop(device, f"its result differs from the eager one by {error:.1e} (relative)", eager)
        checked.add(shapes)
        self.state[device] = "checked"
        return got

    @property
    def compiled(self) -> Callable:
        if self._compiled is None:
            self._compiled = self._compile(self.fn)
        return self._compiled

    def _drop(self, device: str, why: str, eager: tuple[torch.Tensor, ...]) -> tuple[torch.Tensor, ...]:
        self.state[device], self.why[device] = "eager", why
        if os.environ.get("RANK", "0") == "0":
            say(f"note: the compiled {self.name} is off on {device} ({why}); the eager one runs (train.compiled_head)")
        return eager


def _failed(e: Exception) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return f"torch.compile failed: {type(e).__name__}: {first}"


def _relative(got: torch.Tensor, truth: torch.Tensor) -> float:
    if got.shape != truth.shape:
        return float("inf")
    if not truth.numel():
        return 0.0
    scale = truth.detach().double().abs().max().clamp(min=1e-30)
    return float((got.detach().double() - truth.detach().double()).abs().max() / scale)
