"""Each decoder layer's MLP run over tiles of the sequence, so that a long row holds one tile's intermediates.

A long pair's peak memory past the vocabulary head is the recomputed layer's activations in the backward, and
the MLP's are most of them: gate, up, activation and product, each `intermediate_size` wide for every token
(4 x 1,536 floats a token on SmolLM2 against its 576-wide hidden states). With `train.mlp_tile_tokens: T`, an
MLP given more than T positions runs on T at a time: the forward keeps only its input and none of the tiles'
intermediates, and the backward recomputes one tile at a time, each tile's intermediates freed before the next.
The MLP acts on each position alone, so the tiles' outputs, concatenated, are its output (the start-up check
below holds each MLP class to that). Under no_grad (the reference, precompute) the tiles just run one after
another.

What it costs: under activation checkpointing, nothing. The MLP's input is saved by a step of its own
(`_Input`) before the tiles run, and is the last tensor a layer saves (in layers whose MLP ends them), so the
layer's recompute in the backward stops there (torch.utils.checkpoint's early stop), and the tiles' backward
recomputes the MLP once, as the layer's recompute would have: two MLP forwards a step, tiled or whole. Without
activation checkpointing the tiles' recompute is one more MLP forward a step.

The MLP is found as a module named `mlp` (every decoder family of the zoo names it so); a mixture of experts
(`experts` inside) is left whole: its router's outputs are recorded per call, and tiles would split them.

`train.mlp_tile_tokens: auto` (the default) tiles, at `AUTO` positions, only where that is free: under activation
checkpointing, the MLPs that `free_mlps` counts recomputed no more often tiled than whole; otherwise none.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch

from dpo_train.attention.unpacked import eager_attention
from dpo_train.errors import ConfigError
from dpo_train.logps.recompute import autocast_state

AUTO = 4096
"""`auto`'s tile: a row longer than this holds one tile's MLP intermediates (0.7 GiB in fp32 for a 7B Llama's
4 x 11,008 floats a position); a row within it, the MLP whole. 4,096 rows keep each projection a large matmul."""

_CHECK_TILE = 3
_CHECK_POSITIONS = 2 * _CHECK_TILE + 1  # three tiles, the last one short


class Tiled:
    """Mixed in ahead of an MLP's own class (`tile`): its forward, over tiles of the positions (dim -2). The tile
    is the class's own (`TILE`, one class per MLP class and tile): nothing is stored on the module."""

    TILE: int

    def forward(self, hidden: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        tile = self.TILE
        whole = super().forward  # the MLP's own forward (the next class after this mixin)
        if args or kwargs or not torch.is_tensor(hidden) or hidden.dim() < 2 or hidden.shape[-2] <= tile:
            return whole(hidden, *args, **kwargs)
        if not torch.is_grad_enabled():
            return torch.cat([whole(part) for part in hidden.split(tile, dim=-2)], dim=-2)
        kept = _Kept()
        if hidden.requires_grad:
            hidden = _Input.apply(hidden, kept)
        else:  # no graph reaches it (nothing before this MLP trains): nothing to save or recompute
            kept.hidden = hidden
        trained = [p for p in self.parameters() if p.requires_grad]
        return _Tiles.apply(hidden, kept, whole, tile, *trained)


class _Kept:
    """Where `_Tiles`' backward finds the MLP's input: the node of `_Input` that saved it, or the tensor itself."""

    ctx: Any = None
    hidden: torch.Tensor | None = None

    def input(self) -> torch.Tensor:
        return self.hidden if self.hidden is not None else self.ctx.saved_tensors[0]


class _Input(torch.autograd.Function):
    """The MLP's input, saved for `_Tiles`' backward as this step's own (identity) saved tensor, before any tile
    runs: the last tensor the layer saves, where a checkpointed layer's recompute stops."""

    @staticmethod
    def forward(ctx, hidden, kept):
        ctx.save_for_backward(hidden)
        kept.ctx = ctx
        return hidden.view_as(hidden)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


class _Tiles(torch.autograd.Function):
    """Forward: the MLP over tiles without a graph. Backward: each tile recomputed with one, and its gradient
    taken (to its input and to the trained parameters, summed over the tiles) before the next tile runs."""

    @staticmethod
    def forward(ctx, hidden, kept, whole, tile, *trained):
        ctx.kept, ctx.whole, ctx.tile, ctx.trained = kept, whole, tile, trained
        ctx.autocast = autocast_state(hidden.device.type)
        with torch.no_grad():
            return torch.cat([whole(part) for part in hidden.split(tile, dim=-2)], dim=-2)

    @staticmethod
    def backward(ctx, grad):
        hidden = ctx.kept.input()
        wants_hidden = ctx.needs_input_grad[0]
        params = [p for p, needs in zip(ctx.trained, ctx.needs_input_grad[4:]) if needs]
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        sums: list[torch.Tensor | None] = [None] * len(params)
        with torch.enable_grad(), torch.autocast(hidden.device.type, **ctx.autocast):
            for start in range(0, hidden.shape[-2], ctx.tile):
                size = min(ctx.tile, hidden.shape[-2] - start)
                part = hidden.narrow(-2, start, size).detach().requires_grad_(wants_hidden)
                inputs = [part] * wants_hidden + params
                got = torch.autograd.grad(ctx.whole(part), inputs, grad.narrow(-2, start, size), allow_unused=True)
                if wants_hidden:
                    grad_hidden.narrow(-2, start, size).copy_(got[0])
                for k, g in enumerate(got[wants_hidden:]):
                    if g is not None:
                        sums[k] = g if sums[k] is None else sums[k].add_(g)
        summed = iter(sums)
        grad_params = [next(summed) if needs else None for needs in ctx.needs_input_grad[4:]]
        return grad_hidden, None, None, None, *grad_params


_CLASSES: dict[tuple[type, int], type] = {}


def tile(module: Any, tokens: int) -> None:
    """Run `module` tiled from now on: its class becomes a subclass with `Tiled` ahead and the tile its `TILE`
    (parameter names and the state dict unchanged, and a deep copy tiled alike)."""
    cls = _untiled(type(module))
    if (cls, tokens) not in _CLASSES:
        extra = {"__module__": cls.__module__, "TILE": tokens}
        _CLASSES[cls, tokens] = type(f"Tiled{cls.__name__}", (Tiled, cls), extra)
    module.__class__ = _CLASSES[cls, tokens]


def _untiled(cls: type) -> type:
    """The MLP's own class under a tiled one."""
    return cls.__mro__[2] if issubclass(cls, Tiled) else cls


def tiles_of(model: Any) -> tuple[tuple[str, int], ...]:
    """(name, tile) of each MLP of `model` that runs tiled, in module order: what `Scoring.tiles` records of the
    policy at start-up, for the checkpoint identity (`Scoring.mlp_tile`) and a reference built apart from it."""
    return tuple((name, m.TILE) for name, m in model.named_modules() if isinstance(m, Tiled))


def apply_tiles(model: Any, tiles: tuple[tuple[str, int], ...]) -> None:
    """Tile `model`'s MLPs as `tiles` (`Scoring.tiles`) says: the same modules, by name, at the same tiles. A model
    built apart from its policy (an FSDP2 reference, from the meta device) runs each MLP as the policy does;
    `auto` may leave some whole (a vision tower's), which a count over the whole model would tile."""
    for name, tokens in tiles:
        tile(model.get_submodule(name), tokens)


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


def apply_setting(model: Any, setting: int | str | None, checkpointed: bool) -> str | None:
    """`train.mlp_tile_tokens` applied to `model`: a count tiles every MLP (`tile_mlps`); `auto` tiles, at `AUTO`
    positions, the MLPs whose tiles are free under the model's activation checkpointing (`free_mlps`), and none
    without it (there tiles would cost an MLP forward); null none. Returns what the run says about it (None:
    nothing, as for auto without checkpointing, which leaves the model as it was)."""
    if setting != "auto":
        tiled = tile_mlps(model, setting)
        return None if setting is None else tile_note(model, tiled, setting)
    if not checkpointed:
        return None
    found, model_name = dict(mlps(model)), type(model).__name__
    if not found:
        return tile_note(model, [], AUTO)
    try:
        free = free_mlps(model)
    except Exception as error:  # noqa: BLE001 - auto only saves memory: a model it cannot count trains as before
        return (
            f"note: {model_name}: its MLPs run whole (train.mlp_tile_tokens: auto could not count them: "
            f"{type(error).__name__}: {error}); a count tiles them"
        )
    for name in free:
        tile(found[name], AUTO)
    whole = len(found) - len(free)
    if not free:
        return (
            f"note: {model_name}: its {whole} MLPs run whole (train.mlp_tile_tokens: auto): under activation "
            "checkpointing their layers' recompute would run them again tiled (a norm after the MLP, say); a "
            "count tiles them anyway, at one more MLP forward a step"
        )
    left = f"; {whole} left whole" if whole else ""
    return f"note: {model_name}: {len(free)} MLPs run in tiles of {AUTO} positions (train.mlp_tile_tokens: auto{left})"


def free_mlps(model: Any) -> list[str]:
    """The MLPs (`mlps`) whose tiles cost no MLP forward under `model`'s activation checkpointing, counted on the
    model itself: each in tiles of one position, a two-token row through its eager attention (`eager_attention`),
    forward and backward to the embeddings, the parameters frozen meanwhile (no gradient is kept) and the RNG
    forked. An MLP whose own forward saw each position twice (the tiles' forward, their backward's recompute) is
    free; three times, its layer's recompute ran it too (a norm after it saves its output). One the row does not
    reach (a vision tower), or that mixes positions, is not. Every module is left as it found it."""
    exact: dict[type, bool] = {}  # one check per class, as `tile_mlps` makes
    found = [(n, m) for n, m in mlps(model) if exact.setdefault(type(m), _tiles_exactly(n, m))]
    classes = {name: type(module) for name, module in found}
    seen: dict[str, int] = dict.fromkeys(classes, 0)
    hooks = [_first_linear(module).register_forward_pre_hook(_counter(seen, name)) for name, module in found]
    trained = [p for p in model.parameters() if p.requires_grad]
    embeddings = model.get_input_embeddings().register_forward_hook(lambda m, args, out: out.requires_grad_())
    try:
        for _, module in found:
            tile(module, 1)
        model.requires_grad_(False)
        with torch.random.fork_rng(devices=[]), eager_attention(model):
            row = torch.zeros(1, 2, dtype=torch.long, device=next(model.parameters()).device)
            logits = model(input_ids=row, use_cache=False).logits
            forward = dict(seen)
            logits.sum().backward()
    finally:
        for hook in (*hooks, embeddings):
            hook.remove()
        for p in trained:
            p.requires_grad_(True)
        for name, module in found:
            module.__class__ = classes[name]
    return [name for name in classes if forward[name] > 0 and seen[name] == 2 * forward[name]]


def _counter(seen: dict[str, int], name: str) -> Any:
    """A forward pre-hook adding its input's positions (dim -2) to `seen[name]`."""

    def count(module: Any, args: tuple) -> None:
        seen[name] += args[0].shape[-2]

    return count


def _first_linear(module: Any) -> Any:
    """The MLP's first linear layer (LoRA's wrapped one too), called once per forward of the MLP; None if it has
    none."""
    return next((m for m in module.modules() if isinstance(getattr(m, "in_features", None), int)), None)


def _tiles_exactly(name: str, module: Any) -> bool:
    """Whether `module` passes `_check` (auto leaves an MLP that fails it whole, where a count refuses it)."""
    try:
        _check(name, module)
    except ConfigError:
        return False
    return True


def tile_mlps(model: Any, tokens: int | None) -> list[str]:
    """Tile every MLP of `model` (`mlps`) at `tokens` positions (None: leave them whole), after checking one
    module of each class on a short random input: whole and tiled must agree, else the MLP mixes positions and
    tiling would change the model's numbers (a ConfigError naming it); a class tiled before in this process
    passed it already. Returns the tiled modules' names."""
    if tokens is None:
        return []
    found = mlps(model)
    for name, module in found:
        if not any(cls is type(module) for cls, _ in _CLASSES) and not isinstance(module, Tiled):  # tiled before
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
    """The MLP's input width: its first linear layer's `in_features`."""
    linear = _first_linear(module)
    return None if linear is None else linear.in_features


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
