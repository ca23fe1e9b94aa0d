"""Why a tokenizer directory does not load: its first malformed file or field, named, where the loaders' own errors
(a RecursionError, a TypeError from inside transformers, the tokenizers library's bare Exception) say neither."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson

UNLOADABLE = (OSError, ValueError, TypeError, AttributeError, KeyError, IndexError, RecursionError, ImportError)
"""What transformers' and our own loaders raise for malformed files (found by loading malformed copies of a real
directory, tests/hostile/test_hostile_tokenizer_round4.py): RecursionError for deeply nested JSON, TypeError or
AttributeError where a value has the wrong type, KeyError for a missing field, ImportError for a class whose library
is not installed. The tokenizers library's Rust errors are bare `Exception`s: `unloadable` matches those by exact
type, so that another exception class (a bug's) still surfaces as itself."""

JSON_FILES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.json",
)
"""The JSON files AutoTokenizer (and the light reader) may read from a tokenizer directory, each an object."""
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt")
"""The files one of which any tokenizer directory holds (a model directory saved without its tokenizer has none)."""
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
"""transformers' named special tokens, in its order (the special-token map's)."""
TOKEN_LISTS = ("additional_special_tokens", "extra_special_tokens")
ORJSON_DEPTH = 1024
"""The nesting orjson reads; deeper is refused (the standard library's reader would exhaust Python's stack)."""
KINDS = {bool: "a boolean", int: "a number", float: "a number", str: "a string", list: "a list", dict: "an object"}


class UnloadableTokenizer(ValueError):
    """A tokenizer directory that does not load; the message names the file and field where they are known."""


def unloadable(error: BaseException) -> bool:
    """Whether `error` is one a loader raises for malformed files (not a bug of ours to let through)."""
    return isinstance(error, UNLOADABLE) or type(error) is Exception  # noqa: E721 - the tokenizers library's


def why_unloadable(directory: str | Path, error: BaseException) -> str:
    """The first malformed file or field of `directory`, else `error` itself, in one line."""
    directory = Path(directory)
    if directory.is_dir() and not any((directory / name).is_file() for name in TOKENIZER_FILES):
        return f"no tokenizer files in it (none of {', '.join(TOKENIZER_FILES)})"
    documents = {}
    for name in JSON_FILES:
        if (directory / name).is_file():
            document, problem = _read(directory / name)
            if problem is not None:
                return f"{name}: {problem}"
            documents[name] = document
    for name, check in (
        ("tokenizer_config.json", _config_problem),
        ("special_tokens_map.json", _special_problem),
        ("added_tokens.json", _added_json_problem),
        ("tokenizer.json", lambda spec: _backend_problem(directory / "tokenizer.json", spec)),
    ):
        if name in documents and (problem := check(documents[name])) is not None:
            return f"{name}: {problem}"
    return f"{type(error).__name__}: {' '.join(str(error).split())[:300]}"


def _read(path: Path) -> tuple[Any, str | None]:
    """A file's JSON object, or the problem: unreadable, not UTF-8 JSON, nested too deeply, not an object."""
    try:
        text = path.read_bytes()
        try:
            value = orjson.loads(text)
        except orjson.JSONDecodeError as e:
            if "depth limit" in str(e):
                return None, f"JSON nested more than {ORJSON_DEPTH} levels deep; a tokenizer file nests a few levels"
            value = json.loads(text.decode("utf-8"))  # what orjson declines but json reads: integers past 64 bits
    except RecursionError:
        return None, "JSON nested too deeply to read; a tokenizer file nests a few levels"
    except OSError as e:
        return None, f"unreadable ({e.strerror or e})"
    except ValueError as e:
        return None, f"not UTF-8 JSON ({e})"
    if not isinstance(value, dict):
        return None, f"is {_kind(value)}, not a JSON object"
    return value, None


def _config_problem(config: dict) -> str | None:
    problem = _special_problem(config)
    if problem is None and not isinstance(config.get("split_special_tokens", False), bool):
        problem = _wrong("split_special_tokens", config["split_special_tokens"], "a boolean: true or false")
    if problem is None and not isinstance(config.get("tokenizer_class", ""), (str, type(None))):
        problem = _wrong("tokenizer_class", config["tokenizer_class"], "a class name, such as TokenizersBackend")
    if problem is None and "added_tokens_decoder" in config:
        problem = _decoder_problem(config["added_tokens_decoder"])
    if problem is None and "chat_template" in config:
        problem = template_problem(config["chat_template"])
    return problem


def _special_problem(document: dict) -> str | None:
    """Named special tokens are a token's text (or the object transformers saves for one); lists hold texts."""
    for name in SPECIAL_TOKEN_NAMES:
        if name in document and not _is_token(document[name]):
            return _wrong(name, document[name], 'the token\'s text, a string such as "</s>"')
    for name in TOKEN_LISTS:
        value = document.get(name)
        tokens = list(value.values()) if isinstance(value, dict) else value  # transformers 5: names to tokens
        if value is not None and not (isinstance(tokens, list) and all(map(_is_token, tokens))):
            return _wrong(name, value, "a list of token texts (strings), or an object of them by name")
    return None


def _is_token(value: Any) -> bool:
    """A token's text, null, or the object transformers saves for an AddedToken (its text under `content`)."""
    if isinstance(value, dict):
        return isinstance(value.get("content"), str)
    return value is None or isinstance(value, str)


def _decoder_problem(decoder: Any) -> str | None:
    """`added_tokens_decoder`: an object from ids to added tokens, each an object whose `content` is a string."""
    if not isinstance(decoder, dict):
        return _wrong("added_tokens_decoder", decoder, 'an object from ids to tokens, {"0": {"content": "<s>"}}')
    for key, token in decoder.items():
        if not key.isdigit() or not isinstance(token, dict) or not isinstance(token.get("content"), str):
            return _wrong(f"added_tokens_decoder[{key!r}]", token, 'an id\'s token, {"content": "<s>", ...}')
    return None


def template_problem(template: Any) -> str | None:
    """A chat template is text, or named texts (a list of {"name", "template"} objects, or an object of texts)."""
    if template is None or isinstance(template, str):
        return None
    if isinstance(template, dict):
        named = list(template.items())
    elif isinstance(template, list) and all(isinstance(t, dict) for t in template):
        named = [(t.get("name"), t.get("template")) for t in template]
    else:
        named = [(None, None)]
    if all(isinstance(name, str) and isinstance(text, str) for name, text in named):
        return None
    return _wrong("chat_template", template, 'a Jinja template\'s text, or [{"name": ..., "template": ...}]')


def _added_json_problem(added: dict) -> str | None:
    for token, index in added.items():
        if not isinstance(index, int) or isinstance(index, bool):
            return _wrong(repr(token), index, "the token's id, an integer")
    return None


def _backend_problem(path: Path, spec: dict) -> str | None:
    """What the tokenizers library says of tokenizer.json, with the model type it declares (a file of another type
    than its fields fails on a field)."""
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(path))
    except Exception as e:  # noqa: BLE001 - the Rust reader's errors are bare Exceptions
        kind = spec["model"].get("type") if isinstance(spec.get("model"), dict) else None
        declared = f" as a {kind} model" if isinstance(kind, str) else ""
        return (
            f"the tokenizers library cannot read it{declared} ({' '.join(str(e).split())[:200]}); use the "
            "tokenizer.json the model was published with"
        )
    return None


def _wrong(field: str, value: Any, allowed: str) -> str:
    return f"{field} is {_shown(value)} ({_kind(value)}); it must be {allowed}"


def _shown(value: Any) -> str:
    text = json.dumps(value, ensure_ascii=False, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def _kind(value: Any) -> str:
    return "null" if value is None else KINDS.get(type(value), type(value).__name__)
