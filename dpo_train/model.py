"""Load the policy (a local HF directory, or a random init from a config) and its frozen reference."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import torch

from dpo_train.config import ModelConfig
from dpo_train.errors import ConfigError


def load_policy(config: ModelConfig, attention: str = "sdpa") -> Any:
    """The policy in fp32 (master weights) with `attention`, an implementation name as
    `dpo_train.attention.choice.attention_for` chose it (registered with transformers before this call)."""
    from transformers import AutoConfig, AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # our own progress line is the one to read

    if config.path:
        if not Path(config.path).is_dir():
            raise ConfigError(f"model.path {config.path} is not a directory; give a local Hugging Face model directory")
        return AutoModelForCausalLM.from_pretrained(config.path, dtype=torch.float32, attn_implementation=attention)
    if not config.init or "config" not in config.init:
        raise ConfigError("model needs path: DIR, or init: {config: FILE_OR_MAPPING, seed: 0}")
    spec = config.init["config"]
    if isinstance(spec, dict):
        spec = dict(spec)
        model_type = spec.pop("model_type", "llama")
        hf_config = AutoConfig.for_model(model_type, **spec)
    else:
        hf_config = AutoConfig.from_pretrained(spec)
    hf_config._attn_implementation = attention
    torch.manual_seed(int(config.init.get("seed", 0)))
    return AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)


def frozen_copy(model: Any) -> Any:
    """The live reference: a copy that never trains and runs without autograd."""
    return copy.deepcopy(model).eval().requires_grad_(False)


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
