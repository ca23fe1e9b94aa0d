"""A tokenizer directory loaded as transformers' AutoTokenizer loads it, without importing transformers (or torch)
where the light reader reproduces its rules (light.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dpo_data.tokenizer.check import UnloadableTokenizer, template_problem, unloadable, why_unloadable

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


def load_tokenizer(directory: str | Path, *, savable: bool = False) -> Any:
    """The tokenizer AutoTokenizer would load from `directory`, or one that reads the same.

    A directory the light reader reproduces (the generic fast class of a plain model type with a tokenizer.json,
    settings it knows; `light.refusal` says why not) is read with the `tokenizers` library and our own chat
    template environment: importing transformers alone costs about a second, torch more. A directory naming the
    generic fast class otherwise is loaded with that class directly: AutoTokenizer would pick the same one, but
    importing it imports torch (its model configs do). Anything else goes through AutoTokenizer. `savable`:
    AutoTokenizer's own object always, which `save_pretrained` writes (a run exports it).

    A directory that does not load (a missing or malformed file, a field of the wrong type, a chat template that is
    not text) is an `UnloadableTokenizer`, a ValueError naming the file and field where they are known: the one rule
    for `dpo-data build`, `dpo-data verify` and `dpo-train` alike."""
    try:
        tokenizer = _auto(directory) if savable else _fastest(directory)
    except Exception as e:  # a loader given arbitrary files raises many types: `unloadable` says which are its
        if not unloadable(e):
            raise
        raise UnloadableTokenizer(why_unloadable(directory, e)) from None
    problem = template_problem(tokenizer.chat_template)
    if problem is not None:  # transformers keeps any value; rendering one that is not text fails on every row
        raise UnloadableTokenizer(problem)
    return tokenizer


def _fastest(directory: str | Path) -> Any:
    from dpo_data.tokenizer.light import read_light

    light = read_light(directory)
    if light is not None:
        return light
    if takes_generic_class(_document(directory, "tokenizer_config.json"), _document(directory, "config.json")):
        if (Path(directory) / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(directory)
    return _auto(directory)


def _auto(directory: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


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


def _document(directory: str | Path, name: str) -> Any:
    """A JSON file of the directory, or None when absent or unreadable (AutoTokenizer then says why)."""
    try:
        return json.loads((Path(directory) / name).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
