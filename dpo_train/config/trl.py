"""The translation of a flat TRL YAML config through TRL's names (`trl_names.TABLE`) into this toolkit's
sections, checked by loading it."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path
from typing import Any

from dpo_train.config.loading import apply_override, load_config, suggest
from dpo_train.config.sections import SECTIONS
from dpo_train.config.strict_yaml import read_yaml_file
from dpo_train.config.trl_names import TABLE, UNSET, Context, Untranslatable, boolean, refuse, shown
from dpo_train.errors import ConfigError


def translate(trl: dict, world: int = 1, overrides: list[str] = ()) -> tuple[dict, list[str]]:
    """A flat TRL config -> (this toolkit's config as sections, notes for the user); every field that does
    not translate is named in one ConfigError. Each value is read as TRL's parser reads it (its row's reader);
    TRL's default is translated for each mapped field the file omits, so the config trains as TRL would;
    `overrides` (--set) apply last."""
    overridden = frozenset(item.partition("=")[0].strip() for item in overrides)
    read, refused = _read_fields(trl)
    filled = {name: row.default for name, row in TABLE.items() if row.convert and row.default is not UNSET}
    ctx = Context({**filled, **read}, world, overridden)
    keys, problems, unused = {}, [], []
    for name in [*trl, *(name for name in filled if name not in trl)]:  # the file's order, then TRL's defaults
        if name in refused:
            problems.append(refused[name])
            continue
        try:
            for key, out in _translate_one(name, ctx.trl[name], ctx, unused).items():
                if key in keys and keys[key][0] != out:
                    problems.append(
                        f"{name} sets {key} to {out!r}, and {keys[key][1]} to {keys[key][0]!r}; make them agree"
                    )
                keys[key] = (out, name)
        except Untranslatable as error:
            problems.append(str(error))
    problems = list(dict.fromkeys(problems))  # bf16 and fp16 share one converter
    if problems:
        raise ConfigError(
            'the TRL config does not translate (docs/train-config.md, "From TRL"):\n  - ' + "\n  - ".join(problems)
        )
    sections: dict = {}
    for key, (value, _) in keys.items():
        section, _, name = key.partition(".")
        sections.setdefault(section, {})[name] = value
    for item in overrides:
        apply_override(sections, item)
    _load(sections, read, overridden)
    return {"format_version": 1, **{s: sections[s] for s in SECTIONS if s in sections}}, _notes(sections, unused)


def _read_fields(trl: dict) -> tuple[dict, dict]:
    """The file's fields as TRL's parser reads them, each through its row's reader, and {key: why} for each
    key that is not a name (`1:`, `true:`, `null:`) or value its reader refuses. A refused field is left out of
    the first: the others then read its TRL default, so that every problem is named at once."""
    read, refused = {}, {}
    for name, value in trl.items():
        if not isinstance(name, str):
            refused[name] = (
                f"the key {name!r} is not a field name (YAML reads it as {_kind(name)}); TRL's fields are names "
                "such as learning_rate: write the field's name, or drop the line"
            )
            continue
        row = TABLE.get(name)
        try:
            read[name] = row.read(name, value) if row is not None and row.read is not None else value
        except Untranslatable as error:
            refused[name] = str(error)
    return read, refused


def _kind(key: Any) -> str:
    """What YAML made of a key that is not text: `null:`, `true:`, `1:`, `2024-01-01:`."""
    if key is None:
        return "null"
    if isinstance(key, bool):
        return "a boolean"
    return "a number" if isinstance(key, (int, float)) else f"a {type(key).__name__}"


def _load(sections: dict, read: dict, overridden: frozenset) -> None:
    """The translation is a config this toolkit accepts, or load_config's problems are named, with the TRL
    fields of the file behind each key they name (a key set by --set is the user's own)."""
    try:
        load_config(sections)
    except ConfigError as error:
        message = str(error)
        behind = [
            f"{key} from {', '.join(f'{name} {shown(read[name])}' for name in names)}"
            for key, names in _setters(read).items()
            if not any(key == done or key.startswith(done + ".") for done in overridden)
            and re.search(re.escape(key).replace(r"\.", "[./]") + r"\b", message)
        ]
        raise ConfigError(message + (f"\n  (from the TRL config: {'; '.join(behind)})" if behind else "")) from None


def _setters(read: dict) -> dict[str, list[str]]:
    """Each key here -> the fields of the file whose row sets it (optim.betas[0] is optim.betas)."""
    setters: dict[str, list[str]] = {}
    for name in read:
        row = TABLE.get(name)
        for key in row.here.split(", ") if row is not None and row.here else ():
            setters.setdefault(re.sub(r"\[\d+\]$", "", key), []).append(name)
    return setters


def _translate_one(name: str, value: Any, ctx: Context, unused: list[str]) -> dict:
    row = TABLE.get(name)
    if row is None:
        return _unknown(name, value, unused)
    if row.convert is not None:
        return row.convert(value, ctx)
    if value in row.harmless and type(value) is type(row.harmless[row.harmless.index(value)]):
        unused.append(name)
        return {}
    refuse(f"{name} is {shown(value)}; this toolkit has no counterpart: {row.note}; drop it")


def _unknown(name: str, value: Any, unused: list[str]) -> dict:
    """A field outside the table: a TrainingArguments field at its default changes nothing (a boolean read as
    TRL reads one); any other value, and any other name, is refused by name."""
    from transformers import TrainingArguments  # only a TRL config needs it

    defaults = {f.name: f.default for f in fields(TrainingArguments) if f.init}
    if name not in defaults:
        refuse(
            f"{name} is not a field of TRL 1.16's DPOConfig, TrainingArguments, ModelConfig or ScriptArguments"
            + suggest(name, list(TABLE) + list(defaults))
        )
    if isinstance(defaults[name], bool):
        value = boolean(name, value)
    if value == defaults[name]:
        unused.append(name)
        return {}
    refuse(f"{name} is {shown(value)}: a transformers TrainingArguments field with no counterpart here; drop it")


def _notes(sections: dict, unused: list[str]) -> list[str]:
    """What the user still has to do before the translated config trains, and what was accepted unused."""
    notes = []
    if not sections.get("data", {}).get("path"):
        notes.append(
            "data.path is empty: build the dataset (dpo-data build ...) and set data.path (--set data.path=DIR)"
        )
    if not sections.get("model", {}).get("path"):
        notes.append(
            "model.path is empty: set it to a local model directory (model_name_or_path, or --set model.path=DIR)"
        )
    if sections.get("reference", {}).get("mode") == "precomputed":
        notes.append(
            f"reference.path is {sections['reference']['path']}: create the sidecar first with "
            "`dpo-train CONFIG --precompute-reference`"
        )
    if unused:
        notes.append(f"accepted, changing nothing here: {', '.join(unused)}")
    return notes


def read_trl(path: str | Path) -> dict:
    """A TRL YAML config (flat fields, as TrlParser reads them), read strictly as every config is."""
    raw = read_yaml_file(Path(path)) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"TRL config {path} must hold a mapping of fields, got {type(raw).__name__}")
    return raw
