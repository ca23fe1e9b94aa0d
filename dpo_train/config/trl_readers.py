"""TRL's readers: each TRL field's value read as TRL's parser reads it (a value given as text through the field's
type, as argparse does with the defaults TrlParser sets from the YAML), inside the range or choices of the key it
becomes here, or refused (`Untranslatable`) naming the field, the value, what is allowed and the fix."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from typing import Any

from dpo_train.config.schema import choices, interval, node
from dpo_train.errors import ConfigError
from dpo_train.step.loss import Interval


class Untranslatable(ConfigError):
    """One TRL field's value that has no translation here; the translator lists every one at once."""


Reader = Callable[[str, Any], Any]
"""(TRL field, its value in the file) -> the value as TRL's parser reads it, or Untranslatable naming the field,
the value, what is allowed and the fix."""


def refuse(message: str) -> None:
    raise Untranslatable(message)


TRUE = ("yes", "true", "t", "y", "1")
FALSE = ("no", "false", "f", "n", "0")
"""transformers' `string_to_bool` (hf_argparser.py), TRL's reading of a boolean given as text: these, in any case."""


def shown(value: Any) -> str:
    """A value as an error quotes it: its repr, cut at 60 characters (a field may hold a whole mapping)."""
    return f"{value!r:.60}"


def boolean(name: str, value: Any) -> bool:
    """A boolean: true or false, or text (an integer's digits too) that TRL's string_to_bool reads."""
    if isinstance(value, bool):
        return value
    word = str(value).lower() if isinstance(value, (str, int)) else None
    if word in TRUE or word in FALSE:
        return word in TRUE
    refuse(
        f"{name} is {shown(value)}; TRL reads a boolean here: true or false, or (its parser's string_to_bool) "
        f"yes/no, true/false, t/f, y/n, 1/0 in any case, quoted or not; set {name}: true or {name}: false"
    )


def _numeric(value: Any) -> int | float | None:
    """A YAML number, or text that int() or float() reads (TRL's parser reads a quoted '1e-5' so); None for
    anything else: a boolean, null, a list, a mapping."""
    if isinstance(value, str):
        for parse in (int, float):
            with contextlib.suppress(ValueError):
                return parse(value)
        return None
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def _span(bounds: Interval) -> str:
    """'in [0, 1]', '> 0', '>= 0' or '' (any finite number)."""
    if bounds.high < math.inf:
        return f"in {bounds}"
    if bounds.low > -math.inf:
        return f"{'>' if bounds.open_low else '>='} {bounds.low:g}"
    return ""


def number(low: float = -math.inf, high: float = math.inf, *, open_low=False, open_high=False, fix="") -> Reader:
    """A number (TRL's float), finite and inside its bounds; `fix` says what to set instead."""
    bounds = Interval(low, high, open_high=open_high, open_low=open_low)

    def read(name: str, value: Any) -> int | float:
        number = _numeric(value)
        if number is None or (isinstance(number, float) and not math.isfinite(number)) or number not in bounds:
            refuse(
                f"{name} is {shown(value)}; here it must be a finite number {_span(bounds)}".rstrip()
                + f"; {fix or f'set {name} to one'}"
            )
        return number

    return read


def count(low: int, high: float = math.inf) -> Reader:
    """A whole number in [low, high] (TRL's int; 2.0 is 2)."""
    span = f">= {low}" if high == math.inf else f"in [{low:_}, {high:_}]"

    def read(name: str, value: Any) -> int:
        number = _numeric(value)
        if number is None or (isinstance(number, float) and not number.is_integer()) or not low <= number <= high:
            refuse(f"{name} is {shown(value)}; here it must be a whole number {span}; set {name} to one")
        return int(number)

    return read


def choice(choices: Iterable[str], explain: str = "") -> Reader:
    """One name of `choices` (TRL's enums and strategies); `explain` says what they become here."""
    choices = tuple(choices)

    def read(name: str, value: Any) -> str:
        if isinstance(value, str) and value in choices:
            return value
        bare = " (YAML reads a bare yes/no/on/off as a boolean: quote the name)" if isinstance(value, bool) else ""
        explained = f" ({explain})" if explain else ""
        refuse(f"{name} is {shown(value)}{bare}; here: {', '.join(choices)}{explained}; set one of them")

    return read


def is_text(value: Any) -> bool:
    """Text that can be a name or a path: a string, not empty."""
    return isinstance(value, str) and value != ""


def names(name: str, value: Any) -> str | list[str]:
    """One name or a list of names (TRL's list[str] fields, which take a single string too), as given."""
    if is_text(value) or (isinstance(value, list) and all(is_text(item) for item in value)):
        return value
    refuse(f"{name} is {shown(value)}; give a name or a list of names ({name}: [a, b]), each as text")


def text(name: str, value: Any) -> str:
    """A path or a name (TRL's str)."""
    if is_text(value):
        return value
    refuse(f"{name} is {shown(value)}; give it as text (a path or a name), quoted where YAML reads it otherwise")


def mapping(name: str, value: Any) -> dict:
    """A mapping of names to values (TRL's dict fields)."""
    if isinstance(value, dict) and all(isinstance(key, str) for key in value):
        return value
    refuse(f"{name} is {shown(value)}; give a mapping of names to values ({name}: {{key: value}}), or drop it")


def numbers(name: str, value: Any) -> list:
    """A list of numbers >= 0 (TRL's list[float]), each read as `number` reads one."""
    if not isinstance(value, list):
        refuse(f"{name} is {shown(value)}; give a list of numbers >= 0 ({name}: [1.0, 0.5])")
    return [number(0)(f"{name}[{index}]", item) for index, item in enumerate(value)]


def optional(read: Reader) -> Reader:
    """The field may also be null (TRL's `X | None`)."""
    return lambda name, value: None if value is None else read(name, value)


def checkpoint(name: str, value: Any) -> str | None:
    """resume_from_checkpoint: a path; null or false resume nothing given (Trainer.train's meaning)."""
    return None if value is None or value is False else text(name, value)


def f_divergence(name: str, value: Any) -> str:
    """TRL's f_divergence_type, also as older configs print its enum ('FDivergenceType.JS_DIVERGENCE')."""
    if isinstance(value, str):
        value = value.removeprefix("FDivergenceType.").lower()
    return choice(choices("loss.f_divergence_type"))(name, value)


def dataset_list(name: str, value: Any) -> list:
    """TRL's `datasets:`: a list of DatasetConfig mappings, each with a path."""
    if isinstance(value, list) and all(isinstance(d, dict) and is_text(d.get("path")) for d in value):
        return value
    refuse(
        f"{name} is {shown(value)}; TRL's form is a list of {{path: OWNER/NAME or a local path, split: train}} "
        "(or {path: json, data_files: FILE}): give each entry a path"
    )


ATTENTION = ("flash_attention_2", "sdpa", "eager")
"""attn_implementation values model.attention takes as they are."""

attention_name = optional(choice(ATTENTION, "model.attention; null: auto"))


def within(path: str, fix: str = "") -> Reader:
    """The reader of a value bound for key `path`, as the key's schema node states it (dpo_train/config/schema.py,
    from the sections): one of its choices, a boolean, or a whole number or a number inside its range; `fix`
    (numbers) says what to set instead. TRL's null is the row's to allow (`optional`)."""
    found = node(path)
    if "enum" in found:
        return choice(found["enum"])
    kind = found["type"] if isinstance(found["type"], str) else next(t for t in found["type"] if t != "null")
    if kind == "boolean":
        return boolean
    bounds = interval(path)
    if kind == "integer":
        return count(int(bounds.low), bounds.high)
    return number(bounds.low, bounds.high, open_low=bounds.open_low, open_high=bounds.open_high, fix=fix)
