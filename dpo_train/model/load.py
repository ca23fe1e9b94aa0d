"""Loading the policy with the attention path `attention.choice` picks for it, packed or unpacked, checked by
`fit_model`; transformers' refusals become named ConfigErrors."""

from __future__ import annotations

from typing import Any

from dpo_state.errors import ToolkitError
from dpo_train.attention import rope, segments, unpacked
from dpo_train.attention.choice import attention_for, first_line, fit_model, packing_refused
from dpo_train.errors import ConfigError
from dpo_train.model.policy import init_config, is_vision_model, load_policy


def load_model(spec: Any, requested: str, place: Any, mesh: Any, layout: str) -> tuple[Any, bool]:
    """The policy loaded with the path `attention_for` picks, checked by `fit_model`, and whether its rows run
    unpacked (the run's `Scoring.unpacked`). transformers' own refusal of an attention (sdpa for Gemma2 or
    GPT-OSS) becomes a named ConfigError; under auto a refused flash-attention falls back to the segment
    attention. A model packing cannot serve (its config says why: `dpo_train.attention.unpacked.reason`) runs
    unpacked under auto, saying so once."""
    if spec.path and is_vision_model(spec.path):
        _check_vision_paths(spec.path, requested, mesh)
    arch, why = _unpacked_reason(spec, layout)
    if requested == unpacked.ATTENTION or why and requested == "auto":
        return _with_rope(_load_unpacked(spec, mesh, arch, why)), True
    if why:  # before transformers' own refusal of sdpa (Bloom), which would name packed paths as the fix
        raise packing_refused(arch, why, requested, layout)
    attention = attention_for(requested, place, mesh, layout)
    try:
        model = load_policy(spec, attention)
    except ToolkitError:
        raise
    except Exception as e:  # noqa: BLE001 - a model class that cannot take this path: named, not a traceback
        if isinstance(e, KeyError) and requested == "auto":  # GPT-Neo: its own attention, no registry
            why = "its class does not go through transformers' attention registry, so no packing path reaches it"
            return _with_rope(_load_unpacked(spec, mesh, arch, why)), True
        if "attention implementation" not in str(e):
            raise ConfigError(
                f"model.attention {requested}: transformers cannot build this model with attention {attention} "
                f"({type(e).__name__}: {first_line(e)}): its class does not go through transformers' attention "
                "registry, so no packing path can keep its segments apart; use model.attention auto, which runs it "
                "unpacked (each sequence alone in a padded batch), or unpacked (docs/train-config.md, supported "
                "architectures)"
            ) from None
        if requested == "auto" and attention == "flash_attention_2":
            segments.register()
            model = load_policy(spec, segments.ATTENTION)
        else:
            raise ConfigError(
                f"model.attention {requested}: transformers refuses it for this model ({first_line(e)}); use "
                "model.attention auto, whose start-up probe takes a path it checked exact for the model"
            ) from None
    fit_model(model, requested, layout)
    return _with_rope(model), False


def _with_rope(model: Any) -> Any:
    """A length-dependent rope (longrope, dynamic NTK) made per sequence before any forward
    (`dpo_train.attention.rope`)."""
    rope.install(model)
    return model


def _check_vision_paths(path: str, requested: str, mesh: Any) -> None:
    """A vision-language model trains packed, through its decoder's packed path: the unpacked path (which would
    run each sequence without its images) and sequence parallelism (which would split an image's tokens over
    ranks) are refused by name, as is a family the packed path cannot express (at load)."""
    if requested == unpacked.ATTENTION:
        raise ConfigError(
            f"model.attention unpacked cannot train the vision-language model {path} (its rows would run without "
            "their images); use model.attention auto, segments, sdpa or eager (docs/vision.md)"
        )
    if mesh is not None and mesh.active:
        raise ConfigError(
            f"distributed.sequence_parallel cannot train the vision-language model {path} yet (an image's tokens "
            "would be split over ranks); remove it (data parallelism and FSDP still apply; docs/vision.md)"
        )


def _unpacked_reason(spec: Any, layout: str) -> tuple[str, str | None]:
    """The class transformers builds for `spec`, and why it needs the unpacked path in `layout` (None: it
    packs), read from its config before any weights load."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        if spec.path:
            config = AutoConfig.from_pretrained(spec.path)
        elif spec.init and "config" in spec.init:
            config = init_config(spec.init["config"])
        else:
            return "the model", None
    except (OSError, ValueError, ConfigError):  # unreadable: load_policy names the problem, fit_model checks
        return "the model", None
    arch = (getattr(config, "architectures", None) or [None])[0]
    why = unpacked.reason(config) or rope.shared_prompt_reason(config, layout)
    return arch or MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type, config.model_type), why


def _load_unpacked(spec: Any, mesh: Any, arch: str, why: str | None) -> Any:
    """The policy with transformers' own attention (sdpa, or eager where transformers has no sdpa for
    it), for its rows to run unpacked. Sequence parallelism splits one row over ranks, which a padded batch of
    whole sequences cannot follow: refused by name."""
    if mesh is not None and mesh.active:
        cause = f": {why}, so packing is off for it" if why else ""
        raise ConfigError(
            f"{arch} trains unpacked (model.attention unpacked{cause}), and the unpacked path cannot "
            "split a sequence over ranks: remove distributed.sequence_parallel (data parallelism and "
            "FSDP still apply)"
        )
    try:
        model = load_policy(spec, "sdpa")
    except ValueError as e:
        if "attention implementation" not in str(e):
            raise
        model = load_policy(spec, "eager")  # Bloom, MPT: transformers has no sdpa for them
    unpacked.note(model, why or "model.attention unpacked asked for it")
    return model
