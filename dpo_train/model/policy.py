"""Load the policy (a local HF directory, or a random init from a config) and its frozen reference."""

from __future__ import annotations

import json
import re
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from dpo_train.config.sections import ModelConfig
from dpo_train.errors import ConfigError


def load_policy(config: ModelConfig, attention: str = "sdpa") -> Any:
    """The policy in fp32 (master weights) with `attention`, an implementation name as
    `dpo_train.attention.choice.attention_for` chose it (registered with transformers before this call)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress line is the one to read

    check_model_paths(config)
    if config.path and is_vision_model(config.path):
        return _load_vision(config.path, attention)
    if config.path:
        try:
            return AutoModelForCausalLM.from_pretrained(config.path, dtype=torch.float32, attn_implementation=attention)
        except OSError as e:  # a config.json beside missing or unreadable weights
            raise ConfigError(
                f"model.path {config.path}: cannot load the model ({e}); pass a complete model directory"
            ) from None
    if not config.init or "config" not in config.init:
        raise ConfigError("model needs path: DIR, or init: {config: FILE_OR_MAPPING, seed: 0}")
    hf_config = init_config(config.init["config"])
    hf_config._attn_implementation = attention
    torch.manual_seed(int(config.init.get("seed", 0)))
    return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)


def is_vision_model(path: str) -> bool:
    """Whether the model at `path` is a vision-language model (its config has a vision part): such a model is
    loaded as one (`_load_vision`), or refused by name where the packed path cannot express its family."""
    from transformers import AutoConfig

    from dpo_train.vision.families import FAMILIES, NOT_YET

    try:
        config = AutoConfig.from_pretrained(path)
    except (OSError, ValueError):  # unreadable: the causal LM load names the problem
        return False
    return config.model_type in FAMILIES or config.model_type in NOT_YET


def _load_vision(path: str, attention: str) -> Any:
    """A vision-language model of a family the packed path expresses (`dpo_train.vision.families`; any other is
    refused by name), with `attention` in its decoder only: the vision tower keeps eager attention, which runs
    each image alone (the packed paths are for the decoder's packed row)."""
    from transformers import AutoConfig, AutoModelForImageTextToText

    from dpo_train.vision.families import family_of

    family_of(AutoConfig.from_pretrained(path))
    implementation = {"text_config": attention, "vision_config": "eager", "": "eager"}
    try:
        return AutoModelForImageTextToText.from_pretrained(
            path, dtype=torch.float32, attn_implementation=implementation
        )
    except OSError as e:
        raise ConfigError(f"model.path {path}: cannot load the model ({e}); pass a complete model directory") from None


def freeze_vision_tower(model: Any) -> list[str]:
    """Freeze a vision-language model's vision tower (`dpo_train.vision.families.TOWERS`) unless
    model.train_vision_tower says train it; returns the frozen module's name ([] for a text model)."""
    from dpo_train.vision.families import tower_of

    found = tower_of(model)
    if found is None:
        return []
    name, tower = found
    tower.requires_grad_(False)
    return [name]


def init_config(spec: str | dict) -> Any:
    """The transformers config `model.init.config` describes; one transformers refuses is a ConfigError."""
    from huggingface_hub.errors import StrictDataclassError
    from transformers import AutoConfig

    try:
        if isinstance(spec, dict):
            spec = dict(spec)
            return AutoConfig.for_model(spec.pop("model_type", "llama"), **spec)
        return AutoConfig.from_pretrained(spec)
    except (StrictDataclassError, ValueError, TypeError, ArithmeticError, OSError) as e:
        said = " ".join(str(e).split())[:300] or type(e).__name__  # huggingface_hub's errors span lines
        raise ConfigError(
            f"model.init.config: transformers cannot build a model config from it ({said}); fix the value it names"
        ) from None


def check_model_paths(config: ModelConfig) -> None:
    """The local paths of the model section exist and are what they name, checked before anything is
    written or loaded: transformers would take a missing path for a Hub repo id, and the toolkit is offline. A
    `model.init.config` of a vision-language model type is refused too (`check_init_is_text`)."""
    if config.path:
        _check_directory("model.path", config.path, "model")
        if not (Path(config.path) / "config.json").is_file():
            raise ConfigError(
                f"model.path {config.path} is not a model directory: no config.json; pass a local Hugging Face "
                "model directory (from save_pretrained)"
            )
    if config.tokenizer:
        _check_directory("model.tokenizer", config.tokenizer, "tokenizer")
    spec = (config.init or {}).get("config")
    if isinstance(spec, str) and not Path(spec).exists():
        raise ConfigError(
            f"model.init.config {spec} does not exist; pass a config.json file, a model directory, or a mapping"
        )
    check_init_is_text(spec)


def check_init_is_text(spec: str | dict | None) -> None:
    """A random init (`model.init.config`) builds a text model: a vision-language model type is refused by name.
    Its image token, vision geometry and processor come with a saved model, and a vision dataset is prepared by
    the processor in the model's own directory (docs/vision.md)."""
    from dpo_train.vision.families import FAMILIES, NOT_YET

    model_type = _init_model_type(spec)
    if model_type in FAMILIES or model_type in NOT_YET:
        raise ConfigError(
            f"model.init.config: model_type {model_type} is a vision-language model, and model.init builds text "
            "models only (a causal LM type such as llama or qwen3); fix: save the vision-language model with its "
            "processor (save_pretrained) and give that directory as model.path instead of model.init"
        )


def _init_model_type(spec: str | dict | None) -> str | None:
    """The model type `model.init.config` names (a mapping's `model_type`, llama without one; a config file's or a
    model directory's config.json); None where it cannot be read (`init_config` names that)."""
    if isinstance(spec, dict):
        return spec.get("model_type", "llama")
    if not isinstance(spec, str):
        return None
    path = Path(spec) / "config.json" if Path(spec).is_dir() else Path(spec)
    try:
        found = json.loads(path.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return found if isinstance(found, str) else None


def _check_directory(key: str, path: str, kind: str) -> None:
    if not Path(path).exists():
        raise ConfigError(
            f"{key} {path} does not exist; pass a local {kind} directory (dpo-train is offline: a Hub repo id "
            "is not downloaded)"
        )
    if not Path(path).is_dir():
        raise ConfigError(f"{key} {path} is a file, not a {kind} directory; pass the directory that holds it")


def embedding_rows(model: Any) -> int:
    """The rows of the model's input embedding (its vocabulary), also when LoRA wraps that layer: PEFT's
    Embedding has `weight` but no `num_embeddings`. Under FSDP2 the weight is a DTensor of the global shape."""
    return int(model.get_input_embeddings().weight.shape[0])


def prepare_for_training(model: Any, activation_checkpointing: bool = False) -> None:
    """Train mode with dropout off (`disable_dropout`), and optionally activation checkpointing of each
    decoder layer."""
    model.train()
    disable_dropout(model)
    if activation_checkpointing:
        if not getattr(model, "supports_gradient_checkpointing", False):
            raise ConfigError(
                f"train.activation_checkpointing: {type(model).__name__} does not support it; set it to false"
            )
        kwargs = {"use_reentrant": False}  # the reentrant variant drops gradients of inputs that need none
        if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5.x name
            model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


DROPOUT_NAME = re.compile(r"drop|jitter", re.IGNORECASE)
"""A config key or module attribute naming a training-time random perturbation: `*dropout*`, `*pdrop`,
`layerdrop`, `drop_path_rate`, `router_jitter_noise`. Its number, where one in (0, 1], is a probability
or a noise scale that only a training forward applies."""

_AS_LOADED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> [(owner, key, value)]


def disable_dropout(model: Any) -> list[str]:
    """Switch off every dropout the model applies in training mode, so that the policy's training forward
    scores a pair as the reference (eval mode) does, and step 1's log-ratios are 0 (TRL's `disable_dropout`
    does the modules only, and Seed-OSS's `F.dropout(p=config.residual_dropout)` stays on there).

    Found generically, not by a list of names: `nn.Dropout` modules (every `_DropoutNd`), every module
    attribute and every config key (sub-configs too) whose name matches `DROPOUT_NAME` and holds a number
    in (0, 1] (models copy such keys into attributes at init, a few read the config in forward). A name can
    lie (PhiMoE's `router_jitter_noise` is a routing threshold its evaluation forward reads): `keep_settings`
    puts back what is no dropout. What a model hard-codes in a call is beyond reach: step 1's checks
    (dpo_train/reference/guard.py, dpo_train/run/alone.py) stop such a run. Everything changed but the
    modules' p comes back for export and for step 1's check (`dropout_as_loaded`). Returns what was zeroed."""
    zeroed, saved = [], []
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.modules.dropout._DropoutNd) and module.p:
            module.p = 0.0
            zeroed.append(f"{name or type(model).__name__} (p)")
        for key, value in list(vars(module).items()):
            if _probability(key, value):
                saved.append((module, key, value))
                setattr(module, key, 0.0)
                zeroed.append(f"{name}.{key}" if name else key)
    for config in _configs(getattr(model, "config", None)):
        for key, value in list(vars(config).items()):
            if _probability(key, value):
                saved.append((config, key, value))
                setattr(config, key, 0.0)
                zeroed.append(f"config.{key}")
    _AS_LOADED.setdefault(model, []).extend(saved)
    return zeroed


def changed_settings(model: Any) -> list[tuple[Any, str, Any]]:
    """(owner, key, value as loaded) of every config key and module attribute `disable_dropout` zeroed on
    `model` (looked up through DDP's `.module` and PEFT's `.model`)."""
    from dpo_train.attention.features import wrapped

    return next((_AS_LOADED[c] for c in wrapped(model) if c is not None and c in _AS_LOADED), [])


@contextmanager
def dropout_as_loaded(model: Any, keys: set[str] | None = None) -> Iterator[None]:
    """The config keys and module attributes `disable_dropout` zeroed (only those named `keys`, when given) as the
    model was loaded with them: while it is saved (an exported model keeps its own dropout for whoever trains
    it next), and while step 1's check scores the model as loaded."""
    saved = [(owner, key, value) for owner, key, value in changed_settings(model) if keys is None or key in keys]
    now = [getattr(owner, key) for owner, key, _ in saved]
    for owner, key, value in saved:
        setattr(owner, key, value)
    try:
        yield
    finally:
        for (owner, key, _), value in zip(saved, now, strict=True):
            setattr(owner, key, value)


def keep_settings(model: Any, keys: set[str]) -> None:
    """Give back, for good, the values `disable_dropout` took from `keys` (settings found not to be dropout)."""
    entries = _AS_LOADED.get(model, [])
    for owner, key, value in entries:
        if key in keys:
            setattr(owner, key, value)
    _AS_LOADED[model] = [entry for entry in entries if entry[1] not in keys]


def _probability(key: str, value: Any) -> bool:
    return bool(DROPOUT_NAME.search(key)) and type(value) in (int, float) and 0 < value <= 1


def _configs(config: Any) -> list[Any]:
    """A config and the configs nested in it (a multimodal model's text and vision configs)."""
    if config is None or not hasattr(config, "to_dict"):
        return []
    nested = [c for value in vars(config).values() for c in _configs(value) if hasattr(value, "to_dict")]
    return [config, *nested]


def reached_by_every_rank(model: Any) -> Any:
    """0 times the sum of `outside_language(model)` (a 0-dim zero tensor; 0 for a text model), added to every
    micro-batch's loss: a rank whose rows hold no image runs no vision tower nor connector, so without it their
    parameters would get no gradient there while another rank's do, and DDP's bucketed all-reduce and FSDP2's
    reduce-scatter would pair different tensors across ranks (a collective mismatch). The term adds an exact zero
    to each such gradient: the step is unchanged."""
    from dpo_train.vision.families import outside_language

    params = outside_language(model)
    return sum(p.sum() for p in params) * 0.0 if params else 0.0
