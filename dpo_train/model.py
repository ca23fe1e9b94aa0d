"""Load the policy (a local HF directory, or a random init from a config) and its frozen reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dpo_train.config import ModelConfig
from dpo_train.errors import ConfigError


def load_policy(config: ModelConfig, attention: str = "sdpa") -> Any:
    """The policy in fp32 (master weights) with `attention`, an implementation name as
    `dpo_train.attention.choice.attention_for` chose it (registered with transformers before this call)."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress line is the one to read

    check_model_paths(config)
    if config.path:
        try:
            return AutoModelForCausalLM.from_pretrained(config.path, dtype=torch.float32, attn_implementation=attention)
        except OSError as e:  # a config.json beside missing or unreadable weights
            raise ConfigError(
                f"model.path {config.path}: cannot load the model ({e}); pass a complete model directory"
            ) from None
    if not config.init or "config" not in config.init:
        raise ConfigError("model needs path: DIR, or init: {config: FILE_OR_MAPPING, seed: 0}")
    hf_config = _init_config(config.init["config"])
    hf_config._attn_implementation = attention
    torch.manual_seed(int(config.init.get("seed", 0)))
    return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)


def _init_config(spec: str | dict) -> Any:
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
    written or loaded: transformers would take a missing path for a Hub repo id, and the toolkit is offline."""
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
    """Train mode with dropout off (as TRL does for DPO: the policy and the reference must score a pair
    the same way), and optionally activation checkpointing of each decoder layer."""
    model.train()
    for module in model.modules():
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
        if isinstance(getattr(module, "attention_dropout", None), float):
            module.attention_dropout = 0.0
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
