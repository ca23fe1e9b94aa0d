"""Whether AutoTokenizer loads a directory with the generic fast class, from its two JSON files: the rule the
loader and the light reader share."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERIC_CLASSES = frozenset({"TokenizersBackend", "PreTrainedTokenizerFast"})
"""The generic fast tokenizer's names in tokenizer_config.json (transformers 5 and 4)."""

PLAIN_MODEL_TYPES = frozenset(
    {
        "cohere",
        "deepseek_v3",
        "gemma",
        "gemma2",
        "gemma3",
        "gemma3_text",
        "gpt2",
        "gpt_neox",
        "granite",
        "llama",
        "mistral",
        "mixtral",
        "olmo2",
        "qwen2_moe",
        "qwen3",
        "qwen3_moe",
        "smollm3",
        "starcoder2",
    }
)
"""Model types whose directory AutoTokenizer loads with the class tokenizer_config.json names: none is among
the types transformers overrides (`MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`, which holds qwen2 and phi3;
tests/data/test_tokenizer_load.py checks the installed version)."""


def takes_generic_class(tokenizer_config: dict | None, model_config: dict | None) -> bool:
    """Whether AutoTokenizer's choice is the generic class: named so, no remote code, and no model config (a
    tokenizer saved alone) or one whose type transformers does not redirect to a class of its own."""
    if not isinstance(tokenizer_config, dict):
        return False
    if model_config is None:  # AutoTokenizer falls back to an empty config: the named class decides
        model_config = {"model_type": "llama"}
    if not isinstance(model_config, dict):
        return False
    remote = "auto_map" in tokenizer_config or "auto_map" in model_config
    return (
        tokenizer_config.get("tokenizer_class") in GENERIC_CLASSES
        and not remote
        and model_config.get("model_type") in PLAIN_MODEL_TYPES
        and "model_name" not in model_config
    )


def document(directory: str | Path, name: str) -> Any:
    """A JSON file of the directory, or None when absent or unreadable (AutoTokenizer then says why)."""
    try:
        return json.loads((Path(directory) / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
