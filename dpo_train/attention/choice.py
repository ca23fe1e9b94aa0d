"""The attention path a run takes, and the refusal, by name, of a path that cannot express the model's attention."""

from __future__ import annotations

import importlib.util
from typing import Any

from dpo_train.attention import flex, rope, segments, sequence_parallel, unpacked, varlen
from dpo_train.attention.features import model_attention, text_config
from dpo_train.errors import ConfigError

_ALL = frozenset(
    {"sliding window", "chunked attention", "attention logit softcapping", "attention sinks", "temperature tuning"}
)
EXPRESSES = {
    segments.ATTENTION: _ALL,
    flex.ATTENTION: _ALL,  # the segment path's masks as one block mask per kind; softcap, sinks, tuning as it
    varlen.ATTENTION: varlen.EXPRESSES,  # FlashAttention's causal window per segment; no chunks, softcap, sinks
    sequence_parallel.ATTENTION: _ALL,
    # the model's own attention code, with our per-kind masks; Llama 4 scales NoPE queries by row index
    "eager": _ALL - {"temperature tuning"},
    unpacked.ATTENTION: _ALL,  # the model's own attention code and masks, one sequence per row
    "sdpa": frozenset({"sliding window", "chunked attention"}),  # masks only: no softcap, no sinks
    "flash_attention_2": frozenset({"sliding window", "attention logit softcapping"}),  # no chunks, no sinks
}
"""Which model attention features each path applies (docs/train-config.md, "Supported architectures")."""


def attention_for(requested: str, place: Any, mesh: Any = None, layout: str = "separate") -> str:
    """auto: varlen flash-attention when it can run (CUDA, bf16, flash-attn installed, separate layout),
    else the segment attention (`dpo_train.attention.segments`: attention per segment, no row-by-row
    mask). flex: FlexAttention over the row, one block mask per layer kind (`dpo_train.attention.flex`;
    never auto's choice). varlen: torch's variable-length FlashAttention over the row's segments, one call
    per layer (`dpo_train.attention.varlen`; CUDA, bf16 or fp16, separate layout). sdpa and eager are
    transformers' own, given the row's masks per layer kind (`dpo_train.attention.inputs.row_inputs`). Under
    sequence parallelism (an active `mesh`) the model runs `dpo_train.attention.sequence_parallel`'s
    attention. unpacked: transformers' sdpa over a padded batch (`load_model` falls back to eager where
    transformers has no sdpa for the model; auto picks it for a model packing cannot serve,
    `dpo_train.attention.unpacked`). `fit_model` then checks the model."""
    if mesh is not None and mesh.active:
        if requested not in ("auto", "sdpa"):
            raise ConfigError(
                f"model.attention {requested} cannot run under distributed.sequence_parallel, which brings "
                "its own attention (over the gathered row with a segment mask); use auto or sdpa"
            )
        sequence_parallel.register()
        return sequence_parallel.ATTENTION
    if requested == unpacked.ATTENTION:
        return "sdpa"
    if layout == "shared_prompt" and requested == "flash_attention_2":
        raise ConfigError(
            "model.attention flash_attention_2 cannot express data.layout shared_prompt (a completion "
            "attends to its prompt segment, never to the other completion); use auto, sdpa or eager"
        )
    if requested == "flex":
        return _flex(place)
    if requested == "varlen":
        return _varlen(place, layout)
    if requested == "segments" or requested == "auto" and not _flash_usable(place, layout):
        segments.register()
        return segments.ATTENTION
    if requested != "auto":
        if requested == "flash_attention_2" and (place.device.type != "cuda" or place.precision != "bf16"):
            raise ConfigError(
                "model.attention flash_attention_2 needs distributed.device cuda and train.precision "
                "bf16; use auto or sdpa"
            )
        return requested
    return "flash_attention_2"


def _flex(place: Any) -> str:
    """flex, registered; on CUDA and the CPU only (torch's FlexAttention kernels), else refused by name."""
    if place.device.type not in ("cuda", "cpu"):
        raise ConfigError(
            f"model.attention flex runs on CUDA and the CPU, not on distributed.device {place.device.type} "
            "(torch's FlexAttention has no kernel for it); use model.attention auto or segments"
        )
    flex.register()
    return flex.ATTENTION


def _varlen(place: Any, layout: str) -> str:
    """varlen, registered, where its kernel can run (`varlen.unusable`), else refused by name."""
    why = varlen.unusable(place.device.type, place.precision, layout)
    if why:
        raise ConfigError(f"model.attention varlen cannot run here: {why}; use model.attention auto, segments or flex")
    varlen.register()
    return varlen.ATTENTION


def _flash_usable(place: Any, layout: str) -> bool:
    cuda_bf16 = place.device.type == "cuda" and place.precision == "bf16"
    return bool(cuda_bf16 and layout == "separate" and importlib.util.find_spec("flash_attn"))


def packing_refused(arch: str, why: str, requested: str, layout: str) -> ConfigError:
    return ConfigError(
        f"{arch}: {why}, so packed pairs would not score as each does alone (data.layout {layout} packs several "
        f"segments per row) and model.attention {requested} packs; use model.attention auto or unpacked "
        "(each sequence alone in a padded batch; docs/train-config.md, supported architectures)"
    )


def fit_model(model: Any, requested: str, layout: str) -> str:
    """Check that the path a packed model runs expresses every feature of its attention, and that packing
    can keep its segments apart (a model it cannot is refused, naming auto and unpacked; one loaded unpacked
    runs its own attention over whole sequences and is never given here); under auto a path that cannot is
    replaced by the segment attention. Returns the implementation name the model then runs."""
    config = text_config(model)  # a vision-language model: its decoder's (the vision tower runs its own)
    attention = config._attn_implementation
    needs = model_attention(model)
    arch = type(model).__name__
    why = unpacked.reason(text_config(model)) or rope.shared_prompt_reason(text_config(model), layout)
    if why:
        raise packing_refused(arch, why, requested, layout)
    missing = {name: layer for name, layer in needs.needs().items() if name not in EXPRESSES.get(attention, _ALL)}
    if not missing:
        return attention
    if requested == "auto":
        segments.register()
        config._attn_implementation = segments.ATTENTION
        return segments.ATTENTION
    feature, layer = next(iter(missing.items()))
    able = [
        name
        for name in ("segments", "eager", "sdpa", "unpacked")
        if set(missing) <= EXPRESSES[_IMPLEMENTATION.get(name, name)]
    ]
    raise ConfigError(
        f"model.attention {requested} cannot express {feature} (layer {layer} of {arch}); it would be "
        f"silently dropped. Use model.attention {_either(['auto', *able])}"
    )


def expresses(model: Any, implementation: str) -> bool:
    """Whether the path `implementation` applies every attention feature the model's layers need."""
    return all(name in EXPRESSES.get(implementation, _ALL) for name in model_attention(model).needs())


_IMPLEMENTATION = {
    "segments": segments.ATTENTION,
    "flex": flex.ATTENTION,
    "varlen": varlen.ATTENTION,
    "unpacked": unpacked.ATTENTION,
}  # model.attention value -> implementation name


def _either(names: list[str]) -> str:
    """['auto', 'segments', 'eager'] -> 'auto, segments or eager'."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


NAMES = {
    segments.ATTENTION: "segments",
    flex.ATTENTION: "flex",
    varlen.ATTENTION: "varlen",
    sequence_parallel.ATTENTION: "sequence parallel",
    unpacked.ATTENTION: "unpacked",
}
"""Implementation name -> what the user calls the path (`model.attention`'s value)."""


def taken(model: Any, requested: str, place: Any, layout: str, unpacked_rows: bool) -> str:
    """The start-up line that says which attention path the run takes (`unpacked_rows`: the model's rows run
    unpacked, `Scoring.unpacked`), and why."""
    attention = text_config(model)._attn_implementation
    name = "unpacked" if unpacked_rows else NAMES.get(attention, attention)
    if requested != "auto":
        why = f"model.attention {requested}"
    elif name == "flash_attention_2":
        why = "auto: CUDA in bf16, flash-attn installed, the separate layout"
    elif name == "segments" and place.device.type == "cpu":
        why = (
            "auto on the CPU: one sdpa call per segment; flex trains through its unfused math there, which "
            "holds each layer's [heads, row, row] scores"
        )
    elif name == "segments":
        why = (
            "auto: flash_attention_2 needs the flash-attn package, bf16 and the separate layout; flex and varlen "
            "become auto's choice once measured on a GPU (set model.attention to try them)"
        )
    else:
        why = "auto, for this model (said above)"
    return f"attention: {name} ({why})"


def checkable(attention: str | None) -> str:
    """The attention a start-up check runs in this one process: the run's own where it can (eager, sdpa, the
    segment attention, flex), else the segment attention (sequence parallelism needs its group, flash-attention
    CUDA), registered."""
    segments.register()
    checked = ("eager", "sdpa", segments.ATTENTION, flex.ATTENTION, varlen.ATTENTION)
    return attention if attention in checked else segments.ATTENTION


def first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0].split(". ")[0]
