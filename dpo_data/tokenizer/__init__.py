"""A tokenizer directory loaded as transformers' AutoTokenizer loads it, without importing transformers (or torch)
where the light reader reproduces its rules (light.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpo_data.tokenizer.check import UnloadableTokenizer, template_problem, unloadable, why_unloadable
from dpo_data.tokenizer.generic import document, takes_generic_class


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
    if takes_generic_class(document(directory, "tokenizer_config.json"), document(directory, "config.json")):
        if (Path(directory) / "tokenizer.json").is_file():
            from transformers import PreTrainedTokenizerFast

            return PreTrainedTokenizerFast.from_pretrained(directory)
    return _auto(directory)


def _auto(directory: str | Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)
