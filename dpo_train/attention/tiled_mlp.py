"""Each decoder layer's MLP run over tiles of the sequence, so that a long row holds one tile's intermediates.

A long pair's peak memory past the vocabulary head is the recomputed layer's activations in the backward, and
the MLP's are most of them: gate, up, activation and product, each `intermediate_size` wide for every token
(4 x 1,536 floats a token on SmolLM2 against its 576-wide hidden states). With `train.mlp_tile_tokens: T`, an
MLP given more than T positions runs on T at a time, each tile under a non-reentrant activation checkpoint:
the forward keeps only the tiles' inputs (views of its own input), and the backward recomputes and frees one
tile's intermediates at a time. The MLP acts on each position alone, so the tiles' outputs, concatenated, are
its output (the start-up check below holds each MLP class to that); the price is one more MLP forward per
step. Under no_grad (the reference, precompute) the tiles just run one after another.

The MLP is found as a module named `mlp` (every decoder family of the zoo names it so); a mixture of experts
(`experts` inside) is left whole: its router's outputs are recorded per call, and tiles would split them.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from dpo_train.errors import ConfigError

ATTRIBUTE = "dpo_mlp_tile"
"""The tile, in positions, on an MLP that runs tiled (read by `Tiled.forward`; a copy of the model keeps it)."""

_CHECK_TILE = 3
_CHECK_POSITIONS = 2 * _CHECK_TILE + 1  # three tiles, the last one short


class Tiled:
    """Mixed in ahead of an MLP's own class (`tile`): its forward, over tiles of the positions (dim -2)."""

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        tile = getattr(self, ATTRIBUTE)
        whole = super().forward  # the MLP's own forward (the next class after this mixin)
        if args or kwargs or not torch.is_tensor(hidden) or hidden.dim() < 2 or hidden.shape[-2] <= tile:
            return whole(hidden, *args, **kwargs)
        parts = hidden.split(tile, dim=-2)
        if torch.is_grad_enabled():
            outputs = [checkpoint(whole, part, use_reentrant=False) for part in parts]
        else:
            outputs = [whole(part) for part in parts]
        return torch.cat(outputs, dim=-2)


_CLASSES: dict[type, type] = {}


def tile(module: Any, tokens: int) -> None:
    """Run `module` tiled from now on: its class becomes a subclass with `Tiled` ahead (parameter names and
    the state dict unchanged, and a deep copy tiled alike)."""
    cls = type(module)
    if not isinstance(module, Tiled):
        if cls not in _CLASSES:
            _CLASSES[cls] = type(f"Tiled{cls.__name__}", (Tiled, cls), {"__module__": cls.__module__})
        module.__class__ = _CLASSES[cls]
    setattr(module, ATTRIBUTE, tokens)


def tile_of(model: Any) -> int | None:
    """The tile `model`'s MLPs run with (None: whole), as `tile_mlps` set it."""
    return next((getattr(m, ATTRIBUTE) for m in model.modules() if isinstance(m, Tiled)), None)


def mlps(model: Any) -> list[tuple[str, Any]]:
    """The modules `tile_mlps` tiles: named `mlp`, holding a linear layer, no `experts` inside, and called with
    the hidden states alone (Bloom's MLP also adds the residual it is given: left whole)."""
    found = []
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] != "mlp":
            continue
        names = {n.rsplit(".", 1)[-1] for n, _ in module.named_modules()}
        if "experts" not in names and _width(module) is not None and _one_input(module):
            found.append((name, module))
    return found


def tile_mlps(model: Any, tokens: int | None) -> list[str]:
    """Tile every MLP of `model` (`mlps`) at `tokens` positions (None: leave them whole), after checking one
    module of each class on a short random input: whole and tiled must agree, else the MLP mixes positions and
    tiling would change the model's numbers (a ConfigError naming it); a class tiled before in this process
    passed it already. Returns the tiled modules' names."""
    if tokens is None:
        return []
    found = mlps(model)
    for name, module in found:
        if type(module) not in _CLASSES and not isinstance(module, Tiled):  # a class tiled before passed
            _check(name, module)  # (the policy's: an FSDP2 reference's shards could not run alone)
        tile(module, tokens)
    return [name for name, _ in found]


def tile_note(model: Any, tiled: list[str], tokens: int) -> str:
    """The line a run says about its tiles: how many MLPs run tiled, or that none could."""
    if tiled:
        name = type(model).__name__
        return f"note: {name}: {len(tiled)} MLPs run in tiles of {tokens} positions (train.mlp_tile_tokens)"
    return (
        f"note: {type(model).__name__}: train.mlp_tile_tokens has nothing to tile (no module named mlp that takes "
        "the hidden states alone; a mixture of experts stays whole): every MLP runs whole"
    )


def _one_input(module: Any) -> bool:
    """Whether the module's forward needs exactly one argument."""
    needed = [
        p
        for p in inspect.signature(module.forward).parameters.values()
        if p.default is p.empty and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
    ]
    return len(needed) == 1


def _width(module: Any) -> int | None:
    """The MLP's input width: its first linear layer's `in_features` (LoRA's wrapped one too)."""
    return next((m.in_features for m in module.modules() if isinstance(getattr(m, "in_features", None), int)), None)


def _check(name: str, module: Any) -> None:
    """`module` on 7 random positions, whole and in tiles of 3: equal, or a ConfigError."""
    weight = next(module.parameters())
    generator = torch.Generator(device="cpu").manual_seed(0)
    hidden = torch.randn(1, _CHECK_POSITIONS, _width(module), generator=generator).to(weight.device, weight.dtype)
    with torch.no_grad():
        whole = module(hidden)
        tiled = torch.cat([module(part) for part in hidden.split(_CHECK_TILE, dim=-2)], dim=-2)
    if not torch.is_tensor(whole) or whole.shape != tiled.shape:
        raise ConfigError(
            f"train.mlp_tile_tokens: {name} ({type(module).__name__}) does not return one tensor of its input's "
            "positions, so it cannot run in tiles; set train.mlp_tile_tokens: null"
        )
    error = float(((tiled - whole).abs().max() / whole.abs().max().clamp(min=1e-12)).float())
    if error > 1e-3:
        raise ConfigError(
            f"train.mlp_tile_tokens: {name} ({type(module).__name__}) mixes positions: run over tiles of "
            f"{_CHECK_TILE} positions its output differs from the whole by {error:.1e} relative, so tiling would "
            "change the model's numbers; set train.mlp_tile_tokens: null"
        )
