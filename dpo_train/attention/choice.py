"""The attention path a run takes, and the refusal, by name, of a path that cannot express the model's attention."""

from __future__ import annotations

import importlib.util
from typing import Any

from dpo_state.errors import ToolkitError
from dpo_train.attention import segments, sequence_parallel
from dpo_train.attention.features import model_attention, model_config
from dpo_train.errors import ConfigError

_ALL = frozenset(
    {"sliding window", "chunked attention", "attention logit softcapping", "attention sinks", "temperature tuning"}
)
EXPRESSES = {
    segments.ATTENTION: _ALL,
    sequence_parallel.ATTENTION: _ALL,
    # the model's own attention code, with our per-kind masks; Llama 4 scales NoPE queries by row index
    "eager": _ALL - {"temperature tuning"},
    "sdpa": frozenset({"sliding window", "chunked attention"}),  # masks only: no softcap, no sinks
    "flash_attention_2": frozenset({"sliding window", "attention logit softcapping"}),  # no chunks, no sinks
}
"""Which model attention features each path applies (docs/train-config.md, "Supported architectures")."""


def attention_for(requested: str, place: Any, mesh: Any = None, layout: str = "separate") -> str:
    """auto: varlen flash-attention when it can run (CUDA, bf16, flash-attn installed, separate layout),
    else the segment attention (`dpo_train.attention.segments`: attention per segment, no row-by-row
    mask). sdpa and eager are transformers' own, given the row's masks per layer kind
    (`dpo_train.attention.inputs.row_inputs`). Under sequence parallelism (an active `mesh`) the model
    runs `dpo_train.attention.sequence_parallel`'s attention. `fit_model` then checks the model."""
    if mesh is not None and mesh.active:
        if requested not in ("auto", "sdpa"):
            raise ConfigError(
                f"model.attention {requested} cannot run under distributed.sequence_parallel, which brings "
                "its own attention (over the gathered row with a segment mask); use auto or sdpa"
            )
        sequence_parallel.register()
        return sequence_parallel.ATTENTION
    if layout == "shared_prompt" and requested == "flash_attention_2":
        raise ConfigError(
            "model.attention flash_attention_2 cannot express data.layout shared_prompt (a completion "
            "attends to its prompt segment, never to the other completion); use auto, sdpa or eager"
        )
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


def _flash_usable(place: Any, layout: str) -> bool:
    cuda_bf16 = place.device.type == "cuda" and place.precision == "bf16"
    return bool(cuda_bf16 and layout == "separate" and importlib.util.find_spec("flash_attn"))


def load_model(spec: Any, requested: str, place: Any, mesh: Any, layout: str) -> Any:
    """The policy loaded with the path `attention_for` picks, checked by `fit_model`. transformers'
    own refusal of an attention (sdpa for Gemma2 or GPT-OSS) becomes a named ConfigError; under auto a
    refused flash-attention falls back to the segment attention."""
    from dpo_train.model import load_policy

    attention = attention_for(requested, place, mesh, layout)
    try:
        model = load_policy(spec, attention)
    except ToolkitError:
        raise
    except Exception as e:  # noqa: BLE001 - a model class that cannot take this path: named, not a traceback
        if "attention implementation" not in str(e):
            raise ConfigError(
                f"model.attention {requested}: transformers cannot build this model with attention {attention} "
                f"({type(e).__name__}: {_first_line(e)}): its class does not go through transformers' attention "
                "registry, so no packing path can keep its segments apart (docs/train-config.md, supported "
                "architectures)"
            ) from None
        if requested == "auto" and attention == "flash_attention_2":
            segments.register()
            model = load_policy(spec, segments.ATTENTION)
        else:
            raise ConfigError(
                f"model.attention {requested}: transformers refuses it for this model ({_first_line(e)}); use "
                "model.attention auto or segments (which apply softcapping and sinks), or eager"
            ) from None
    fit_model(model, requested, layout)
    return model


def fit_model(model: Any, requested: str, layout: str) -> str:
    """Check that the path the model runs expresses every feature of its attention, and that packing
    can keep its segments apart; under auto a path that cannot is replaced by the segment attention.
    Returns the implementation name the model then runs."""
    config = model_config(model)
    attention = config._attn_implementation
    needs = model_attention(model)
    arch = type(model).__name__
    if needs.mixers:
        layer, kind = needs.mixers[0]
        raise ConfigError(
            f"{arch}: layer {layer} is a '{kind}' layer, a sequence mixer that carries state from one "
            "token to the next without seeing segment boundaries, so packed pairs would leak into each "
            f"other (data.layout {layout} packs several segments per row); no path can keep them apart "
            "yet: train a model whose layers are all attention (docs/train-config.md, supported architectures)"
        )
    missing = {name: layer for name, layer in needs.needs().items() if name not in EXPRESSES.get(attention, _ALL)}
    if not missing:
        return attention
    if requested == "auto":
        segments.register()
        config._attn_implementation = segments.ATTENTION
        return segments.ATTENTION
    feature, layer = next(iter(missing.items()))
    able = [
        name for name in ("segments", "eager", "sdpa") if set(missing) <= EXPRESSES[_IMPLEMENTATION.get(name, name)]
    ]
    raise ConfigError(
        f"model.attention {requested} cannot express {feature} (layer {layer} of {arch}); it would be "
        f"silently dropped. Use model.attention {_either(['auto', *able])}"
    )


_IMPLEMENTATION = {"segments": segments.ATTENTION}  # model.attention value -> implementation name


def _either(names: list[str]) -> str:
    """['auto', 'segments', 'eager'] -> 'auto, segments or eager'."""
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " or " + names[-1]


def _first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0].split(". ")[0]
