"""The tiny random Llama that tests and benchmarks build: one spec, a variant by keyword, as a spec or a model."""

from __future__ import annotations

from typing import Any

TINY_LLAMA = {
    "model_type": "llama",
    "vocab_size": 49152,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
}
"""A random Llama with SmolLM2's vocabulary (the real tokenizer's ids embed), two small layers."""


def tiny_llama(**changes: Any) -> dict:
    """TINY_LLAMA with `changes`: the spec a run's `model.init.config` takes, or `tiny_llama_model` builds."""
    return {**TINY_LLAMA, **changes}


def tiny_llama_model(**changes: Any) -> Any:
    """A random `LlamaForCausalLM` of `tiny_llama(**changes)` (a config keyword such as `attn_implementation` too),
    its weights drawn from torch's generator as it stands: the caller seeds it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    return AutoModelForCausalLM.from_config(AutoConfig.for_model(**tiny_llama(**changes)))
