"""Length-dependent rotary embeddings (longrope, dynamic NTK) computed per sequence, as each gets them alone."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from types import MethodType
from typing import Any

import torch
from transformers.modeling_rope_utils import dynamic_rope_update

from dpo_train.errors import ConfigError

_DECORATED = dynamic_rope_update(lambda self, x, position_ids: None).__code__
"""The code object of every forward transformers wraps in `dynamic_rope_update`: the rotary classes whose
frequencies it recomputes from the batch's largest position (longrope switches factors past
`original_max_position_embeddings`; dynamic NTK grows its base past `max_position_embeddings`, and keeps it)."""

_STATE = ("max_seq_len_cached", "attention_scaling")
"""Attribute name endings `dynamic_rope_update` changes besides the module's buffers (a layer-typed rotary
module prefixes them with the layer type)."""


def length_dependent(module: Any) -> bool:
    """Whether `module` is a rotary embedding whose frequencies depend on the length of what it is given."""
    forward = getattr(type(module), "forward", None)
    if getattr(forward, "__code__", None) is not _DECORATED:
        return False
    types = module.rope_type.values() if isinstance(module.rope_type, dict) else [module.rope_type]
    return any("dynamic" in t or t == "longrope" for t in types)


def install(model: Any) -> list[Any]:
    """Make every length-dependent rotary module of `model` compute each sequence's frequencies from that
    sequence's own length (idempotent; returns those modules). Called at load, before any forward, so the
    state it keeps as fresh is the state transformers builds."""
    found = [m for m in _modules(model) if length_dependent(m)]
    for module in found:
        if "dpo_fresh" not in vars(module):
            module.dpo_fresh = _snapshot(module)
            module.dpo_lengths = None
            # a method bound to the module (not a closure): a deepcopy (the frozen reference) binds its copy
            module.forward = MethodType(_per_sequence_forward, module)
    return found


def _modules(model: Any) -> Iterator[Any]:
    """The modules of `model`, or of the module it wraps (the LoRA reference, `AdaptersDisabled`, is no module)."""
    inner = model if hasattr(model, "modules") else getattr(model, "model", None)
    return inner.modules() if inner is not None else iter(())


def _snapshot(module: Any) -> dict[str, Any]:
    """The module's buffers and `_STATE` attributes as transformers built them: its fresh state."""
    buffers = {name: b.detach().clone() for name, b in module._buffers.items() if b is not None}
    attributes = {k: v for k, v in vars(module).items() if k.endswith(_STATE) and not torch.is_tensor(v)}
    return {"buffers": buffers, "attributes": attributes}


def _restore(module: Any, device: torch.device) -> None:
    """Put the module back in its fresh state: as transformers built it, before any forward changed it."""
    fresh = module.dpo_fresh
    for name, buffer in fresh["buffers"].items():
        now = module._buffers.get(name)
        if now is not None and now.shape == buffer.shape and now.device == device:
            now.copy_(buffer)  # in place where it can: the buffer keeps its address (DDP and CUDA graphs hold it)
        else:
            module._buffers[name] = buffer.to(device).clone()
    for key, value in fresh["attributes"].items():
        setattr(module, key, value)


def _per_sequence_forward(self: Any, x: torch.Tensor, position_ids: torch.Tensor, *args: Any, **kwargs: Any):
    """The module's own forward, once per distinct sequence length in the batch, each time from its fresh state,
    every token taking the result of its own sequence's length: exactly what that sequence gets run alone by a
    model just loaded. `self.dpo_lengths` ([B, T] or [T], set by `sequence_lengths`) gives each token the length of
    its sequence; unset, each row is one sequence (its largest position + 1)."""
    decorated = type(self).forward
    lengths = self.dpo_lengths
    if lengths is None:
        lengths = position_ids.amax(-1, keepdim=True) + 1
    lengths, positions = torch.broadcast_tensors(_regime(self, lengths.to(position_ids.device)), position_ids)
    cos = sin = None
    for length in torch.unique(lengths).tolist():  # one sync a forward: a handful of lengths
        _restore(self, x.device)
        # transformers reads the sequence length as the largest position + 1: one position says it
        decorated(self, x[:, :1], torch.full_like(positions[:1, :1], length - 1), *args, **kwargs)
        got_cos, got_sin = decorated.__wrapped__(self, x, positions, *args, **kwargs)
        if cos is None:
            cos, sin = got_cos, got_sin
        else:
            mine = (lengths == length)[..., None]
            cos, sin = torch.where(mine, got_cos, cos), torch.where(mine, got_sin, sin)
    _restore(self, x.device)
    return cos, sin


def _regime(module: Any, lengths: torch.Tensor) -> torch.Tensor:
    """Each length replaced by the shortest one that gets the same frequencies (longrope: two sets, either side of
    its original length; dynamic NTK: every length up to `max_position_embeddings` keeps the loaded base), so
    the module's forward runs once per set, not once per sequence."""
    rope = _rope_parameters(module.config)
    kind, limits = str(rope.get("rope_type", rope.get("type", ""))), thresholds(module.config)
    if not limits:
        return lengths
    if kind == "longrope":
        return torch.where(lengths > limits[0], limits[0] + 1, limits[0])
    return lengths.clamp(min=limits[0])


def _rope_parameters(config: Any) -> dict:
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return rope if isinstance(rope, dict) else {}


@contextmanager
def sequence_lengths(model: Any, lengths: Callable[[], torch.Tensor]) -> Iterator[None]:
    """Meanwhile, the model's length-dependent rotary modules give each token the frequencies of its own
    sequence's length (`lengths()`, broadcastable to the position_ids the model gets: [1, T] for a packed row,
    [N, 1] for a padded batch; called only for such a model). A model without such modules is untouched. A
    model built without `install` (the FSDP2 reference, created again on the meta device) is installed here."""
    modules = install(model)
    given = lengths() if modules else None
    for module in modules:
        module.dpo_lengths = given
    try:
        yield
    finally:
        for module in modules:
            module.dpo_lengths = None


def row_lengths(batch: dict[str, Any]) -> torch.Tensor:
    """[1, T]: for each token of a packed row, the length of the sequence it belongs to (its last position + 1:
    a completion continuing its shared prompt counts the prompt too). A shared prompt gets its longer
    completion's (`shared_prompt_reason` unpacks that layout where it would matter); row padding is its own sequence."""
    positions = batch["position_ids"][0]
    lengths = batch["segment_length"].long().to(positions.device)
    starts = batch["cu_seqlens"].long().to(positions.device)[:-1]
    ends = positions[starts + lengths - 1] + 1  # a segment's last position + 1
    if "segment_context" in batch:  # a prompt segment: the longest sequence it opens
        context = batch["segment_context"].long().to(positions.device)
        opened = context >= 0
        ends = ends.scatter_reduce(0, context[opened], ends[opened], reduce="amax")
    per_token = torch.repeat_interleave(ends, lengths)
    tail = positions.shape[0] - per_token.shape[0]  # row padding past the segments
    if tail:
        per_token = torch.cat([per_token, positions[-tail:].amax()[None].expand(tail) + 1])
    return per_token[None]


def shard_lengths(batch: dict[str, Any], shard: Any) -> torch.Tensor:
    """`row_lengths` of the positions a sequence-parallel rank forwards (the whole row without a `shard`); the
    padding `split_row` adds is a sequence of its own."""
    lengths = row_lengths(batch)
    if shard is None:
        return lengths
    if shard.extra:
        lengths = torch.cat([lengths, lengths.new_full((1, shard.extra), shard.extra)], dim=1)
    return lengths[:, shard.start : shard.stop]


def shared_prompt_reason(config: Any, layout: str) -> str | None:
    """Why the shared-prompt layout cannot pack this model (None where it can): a shared prompt is one set of
    keys for both completions, but a length-dependent rope rotates it by each whole sequence's length, so it
    would need one rotation per completion. Such a model runs unpacked there (each prompt + completion alone)."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    if layout != "shared_prompt" or not thresholds(config):
        return None
    kind = _rope_parameters(config).get("rope_type", _rope_parameters(config).get("type"))
    return (
        f"its {kind} rope depends on each sequence's length, so the prompt both completions share would need two "
        "rotations (data.layout separate packs it)"
    )


def thresholds(config: Any) -> list[int]:
    """The lengths at which a length-dependent rope changes: longrope's original length, dynamic NTK's
    `max_position_embeddings` (its frequencies grow with every length past it)."""
    rope = _rope_parameters(config)
    kind = str(rope.get("rope_type", rope.get("type", "")))
    if kind == "longrope" and rope.get("original_max_position_embeddings"):
        return [int(rope["original_max_position_embeddings"])]
    if "dynamic" in kind and getattr(config, "max_position_embeddings", None):
        return [int(config.max_position_embeddings)]
    return []


def check_rotary(model: Any) -> None:
    """The start-up probe's rope part, at every threshold however long: two sequences packed in one row, one
    past the threshold and one under it, must get exactly the cos and sin each gets alone."""
    for module in install(model):
        for threshold in thresholds(module.config):
            _check_at(model, module, threshold)


def _check_at(model: Any, module: Any, threshold: int) -> None:
    device = next(iter(module.dpo_fresh["buffers"].values())).device
    sizes = (threshold + 1, max(threshold // 2, 1))
    positions = torch.cat([torch.arange(n, device=device) for n in sizes])[None]
    lengths = torch.cat([torch.full((n,), n, device=device) for n in sizes])[None]
    x = torch.zeros(1, 1, 1, device=device)
    kwargs = {}
    if isinstance(module.rope_type, dict):
        kwargs = {"layer_type": next(iter(module.rope_type))}
    with sequence_lengths(model, lambda: lengths):
        packed = module(x, positions, **kwargs)
    start = 0
    for n in sizes:  # transformers' own forward on a module just loaded: the truth
        _restore(module, device)
        alone = type(module).forward(module, x, positions[:, start : start + n], **kwargs)
        _restore(module, device)
        for got, want in zip(packed, alone, strict=True):
            if not torch.equal(got[:, start : start + n], want):
                raise ConfigError(
                    f"{type(model).__name__}: its rotary embedding gives a sequence of {n} positions packed beside "
                    f"one of {sum(sizes) - n} other values than alone (its rope changes at {threshold} tokens), so "
                    "packed pairs would train on wrong numbers; report the model; train.probe_packing: false skips "
                    "this check at your own risk"
                )
        start += n
