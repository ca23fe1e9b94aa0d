"""The translation of a flat TRL YAML config through TRL's names (`trl_table.TABLE`) into this toolkit's
sections, checked by loading it."""

from __future__ import annotations

import re
import shlex
from dataclasses import fields
from pathlib import Path
from typing import Any

from dpo_train.config.loading import load_config, suggest
from dpo_train.config.overrides import apply_override
from dpo_train.config.sections import SECTIONS
from dpo_train.config.strict_yaml import read_yaml_file
from dpo_train.config.trl_convert import Context
from dpo_train.config.trl_readers import Untranslatable, boolean, refuse, shown
from dpo_train.config.trl_table import TABLE, UNSET
from dpo_train.errors import ConfigError


def translate(trl: dict, world: int = 1, overrides: list[str] = ()) -> tuple[dict, list[str]]:
    """A flat TRL config -> (this toolkit's config as sections, notes for the user); every field that does
    not translate is named in one ConfigError. Each value is read as TRL's parser reads it (its row's reader);
    TRL's default is translated for each mapped field the file omits, so the config trains as TRL would;
    `overrides` (--set) apply last."""
    overridden = frozenset(item.partition("=")[0].strip() for item in overrides)
    read, refused = _read_fields(trl)
    filled = {name: row.default for name, row in TABLE.items() if row.convert and row.default is not UNSET}
    ctx = Context({**filled, **read}, world, overridden, frozenset(read))
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
    sections: dict = {}
    for key, (value, _) in keys.items():
        section, _, name = key.partition(".")
        sections.setdefault(section, {})[name] = value
    printed = {name: sections.pop(name, {}) for name in PRINTED}
    for item in overrides:
        apply_override(sections, item)
    problems += _unbuilt(sections, printed["build"], keys, read)
    problems = list(dict.fromkeys(problems))  # bf16, fp16 and dtype share one converter
    if problems:
        raise ConfigError(
            'the TRL config does not translate (docs/train-config.md, "From TRL"):\n  - ' + "\n  - ".join(problems)
        )
    _load(sections, read, overridden)
    unused = sorted([*unused, *printed["unused"]], key=list(trl).index)  # the file's order
    notes = _notes(sections, printed, unused, built="data.path" in keys)
    return {"format_version": 1, **{s: sections[s] for s in SECTIONS if s in sections}}, notes


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
            f"{name} is not a field of TRL 1.16's DPOConfig, TrainingArguments, ModelConfig, ScriptArguments or "
            "DatasetMixtureConfig" + suggest(name, list(TABLE) + list(defaults))
        )
    if isinstance(defaults[name], bool):
        value = boolean(name, value)
    if value == defaults[name]:
        unused.append(name)
        return {}
    refuse(f"{name} is {shown(value)}: a transformers TrainingArguments field with no counterpart here; drop it")


PRINTED = ("build", "push", "note", "unused")
"""What a row's converter returns besides config keys (`build.--max-length`, `push.repo`, `note.FIELD`,
`unused.FIELD`): the `dpo-data build` and `dpo-state push` commands the translation prints, its notes, and the
fields accepted without changing anything."""


def build_command(build: dict, sections: dict, out: str) -> str:
    """The `dpo-data build` command the TRL config's dataset and build-time fields make, into `out`."""
    inputs = build.get("inputs") or ["RAW_FILES"]
    tokenizer = sections.get("model", {}).get("tokenizer") or sections.get("model", {}).get("path") or "MODEL_DIR"
    options = [f"{option} {value}" for option, value in sorted(build.items()) if option.startswith("--")]
    words = ["dpo-data build", *map(shlex.quote, inputs), "--tokenizer", shlex.quote(tokenizer), "--out", out]
    return " ".join(words + options)


def _data_out(sections: dict) -> str:
    """Where the printed build writes: data.path when the user gives one, else beside the run's output."""
    path = sections.get("data", {}).get("path")
    return shlex.quote(path if isinstance(path, str) and path else f"{sections['train']['output_dir']}-dataset")


def _unbuilt(sections: dict, build: dict, keys: dict, read: dict) -> list[str]:
    """A dataset named in the TRL config that is not built yet: refused with the command that builds it (the
    run reads only built, attested datasets), unless --set data.path gives one."""
    if "inputs" not in build or sections.get("data", {}).get("path"):
        return []
    name, out = keys["build.inputs"][1], _data_out(sections)
    return [
        f"{name} names {', '.join(build['inputs'])}, not built; here data.path is a dataset built by dpo-data "
        f"build (tokenized, attested): build it with `{build_command(build, sections, out)}`, then translate "
        f"again with --set data.path={out}"
    ]


def _notes(sections: dict, printed: dict, unused: list[str], built: bool) -> list[str]:
    """What the user still has to do before the translated config trains (the build command the TRL config
    implies, unless its dataset_name is built), what to run after it (push), the converters' notes, and what
    was accepted unused."""
    notes = []
    if not sections.get("data", {}).get("path"):
        command = build_command(printed["build"], sections, _data_out(sections))
        notes.append(f"data.path is empty: build the dataset (`{command}`) and set data.path (--set data.path=DIR)")
    elif not built:
        notes.append(
            f"data.path is {sections['data']['path']}; the TRL config builds it with "
            f"`{build_command(printed['build'], sections, _data_out(sections))}`"
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
    notes += printed["note"].values()
    push = printed["push"]
    if push:
        final = shlex.quote(f"{sections['train']['output_dir']}/final")
        private = " --private" if push["--private"] else ""
        namespace = " (NAMESPACE: your Hub user or organization)" if push["repo"].startswith("NAMESPACE/") else ""
        repo = shlex.quote(push["repo"])  # every printed value is quoted: a recipe's value is never shell code
        notes.append(f"push_to_hub: after training, `dpo-state push {final} {repo}{private}`{namespace}")
    if unused:
        notes.append(f"accepted, changing nothing here: {', '.join(unused)}")
    return notes


def read_trl(path: str | Path) -> dict:
    """A TRL YAML config (flat fields, as TrlParser reads them), read strictly as every config is."""
    raw = read_yaml_file(Path(path)) or {}
    if not isinstance(raw, dict):
        raise ConfigError(f"TRL config {path} must hold a mapping of fields, got {type(raw).__name__}")
    return raw
