"""A tokenizer directory read with the `tokenizers` library alone, as transformers 5's generic fast class reads it.

`read_light(directory)` returns a `LightTokenizer` only for directories whose every file and setting it reproduces
(`refusal` names the first thing it does not); anything else is left to transformers. What the build and the
attestation read from a tokenizer (the Rust backend, added and special tokens, the chat template, four flags,
its length) is then what transformers' object holds, step by step as `TokenizersBackend.__init__` and
`PreTrainedTokenizerBase._from_pretrained` make it (transformers 5.24, read in its sources):

- the backend is `tokenizer.json` (`Tokenizer.from_file`); a file with truncation or padding baked in is refused;
- the added tokens are tokenizer_config.json's `added_tokens_decoder`, else tokenizer.json's own, all added again
  (with the special tokens and `extra_special_tokens` missing from them) in transformers' order;
- `add_bos_token`/`add_eos_token` are dropped when tokenizer.json exists (transformers pops them), so both are
  False, and a backend without a post-processor gets the plain `$A`/`$A $B` one;
- the chat template is `chat_template.jinja` and `additional_chat_templates/*.jinja` when present (one file: its
  text; several: a dict by name), else tokenizer_config.json's (a list of named templates becomes a dict);
- a Mistral-type directory whose vocabulary passes 100,000 (where transformers may patch the pre-tokenizer's
  regex) is refused.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import orjson

from dpo_data.tokenizer.chat import chat_environment, jinja_supported, render, without_none
from dpo_data.tokenizer.check import SPECIAL_TOKEN_NAMES
from dpo_data.tokenizer.generic import takes_generic_class

TRANSFORMERS_MAJOR = "5"
"""The transformers major version whose loading rules this module reproduces; another is left to transformers."""
FLAGS = ("clean_up_tokenization_spaces", "split_special_tokens")
"""tokenizer_config.json's behaviour flags (booleans, default False)."""
INERT_KEYS = frozenset(
    {
        "add_bos_token",  # popped by transformers when tokenizer.json exists
        "add_eos_token",
        "add_prefix_space",  # kept as an attribute; the backend's pre-tokenizer decides
        "backend",
        "errors",
        "is_local",  # the three are rewritten at every load
        "legacy",
        "local_files_only",
        "model_input_names",
        "model_max_length",
        "name_or_path",
        "processor_class",
        "sp_model_kwargs",
        "spaces_between_special_tokens",
        "tokenizer_class",
        "use_default_system_prompt",
    }
)
"""tokenizer_config.json keys transformers' generic class stores or drops without changing ids, tokens, template
or flags. A key outside these, the special tokens, the flags and the template sends the directory to transformers."""
SIDES = ("padding_side", "truncation_side")
MISTRAL_TYPES = frozenset({"mistral", "mistral3", "voxtral", "ministral", "pixtral"})
"""Model types whose large-vocabulary tokenizers transformers may re-patch on load (`_patch_mistral_regex`)."""
TEMPLATE_DIR = "additional_chat_templates"
LEGACY_FILES = ("special_tokens_map.json", "added_tokens.json")
"""Files transformers reads only when tokenizer_config.json has no `added_tokens_decoder`: refused then."""
TRANSFORMERS_OPTIONS = frozenset(
    {
        "chat_template",
        "continue_final_message",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_assistant_tokens_mask",
        "sanitize_control_tokens",
        "tokenizer_kwargs",
    }
)
"""`apply_chat_template` options of transformers' that `LightTokenizer.apply_chat_template` does not take."""


class Refused(Exception):
    """What the light path does not reproduce, in a few words (the directory then goes to transformers)."""


def refusal(directory: str | Path) -> str | None:
    """Why `read_light` leaves `directory` to transformers, or None when it reads it."""
    try:
        _read(Path(directory))
    except Refused as e:
        return str(e)
    return None


def read_light(directory: str | Path) -> LightTokenizer | None:
    """The tokenizer of `directory` read without transformers, or None where that would be a guess."""
    try:
        return _read(Path(directory))
    except Refused:
        return None


@dataclass(eq=False)  # identity, as for transformers' objects: the attestation caches per object (weakly)
class LightTokenizer:
    """The parts of a transformers fast tokenizer that the build and the attestation read, with the same values:
    `backend_tokenizer`, `added_tokens_decoder`, `special_tokens_map`, `convert_tokens_to_ids`, `eos_token_id`,
    `chat_template` (settable), `get_chat_template`, `apply_chat_template`, the flags and `len()`."""

    backend_tokenizer: Any
    special_tokens: dict[str, str]
    chat_template: str | dict | None
    clean_up_tokenization_spaces: bool = False
    split_special_tokens: bool = False
    add_bos_token: bool = False
    add_eos_token: bool = False
    name_or_path: str = ""
    _compiled: dict = field(default_factory=dict, repr=False, compare=False)

    is_fast = True

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    def __getstate__(self) -> dict:  # compiled templates do not pickle; they are rebuilt on use
        return {**self.__dict__, "_compiled": {}}

    @property
    def added_tokens_decoder(self) -> dict:
        return self.backend_tokenizer.get_added_tokens_decoder()

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return dict(self.special_tokens)

    @property
    def eos_token_id(self) -> int | None:
        eos = self.special_tokens.get("eos_token")
        return None if eos is None else self.convert_tokens_to_ids(eos)

    def convert_tokens_to_ids(self, tokens: str | list[str]) -> Any:
        """A token's id, the unknown token's for one outside the vocabulary (None without an unknown token)."""
        if not isinstance(tokens, str):
            return [self.convert_tokens_to_ids(token) for token in tokens]
        found = self.backend_tokenizer.token_to_id(tokens)
        unk = self.special_tokens.get("unk_token")
        return found if found is not None or unk is None else self.backend_tokenizer.token_to_id(unk)

    def get_chat_template(self, chat_template: str | None = None, tools: list | None = None) -> str:
        """The template text a rendering uses: a named one of several (`tool_use` with tools, else `default`)."""
        own = self.chat_template
        if isinstance(own, dict):
            if chat_template is not None and chat_template in own:
                return own[chat_template]
            if chat_template is None:
                if tools is not None and "tool_use" in own:
                    return own["tool_use"]
                if "default" in own:
                    return own["default"]
                raise ValueError(
                    "This model has multiple chat templates with no default specified! Please either pass a chat "
                    "template or the name of the template you wish to use to the `chat_template` argument. "
                    f"Available template names are {sorted(own)}."
                )
        elif chat_template is None:
            if own is None:
                raise ValueError(
                    "Cannot use chat template functions because tokenizer.chat_template is not set and no template "
                    "argument was passed! For information about writing templates and setting the "
                    "tokenizer.chat_template attribute, please see the documentation at "
                    "https://huggingface.co/docs/transformers/main/en/chat_templating"
                )
            return own
        return chat_template

    def apply_chat_template(
        self,
        conversation: list,
        tools: list | None = None,
        documents: list | None = None,
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_dict: bool = True,
        **variables: Any,
    ) -> Any:
        """transformers' `apply_chat_template` for one conversation: the rendering, or its ids (encoded without
        special tokens added); `variables` reach the template. Batches and transformers' other options are refused
        (TypeError) rather than passed to the template as variables."""
        taken = TRANSFORMERS_OPTIONS & variables.keys()
        if taken:
            raise TypeError(f"LightTokenizer.apply_chat_template does not take {sorted(taken)}; load with transformers")
        if isinstance(conversation, (list, tuple)) and not conversation:
            raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
        if isinstance(conversation[0], (list, tuple)) or hasattr(conversation[0], "messages"):
            raise TypeError("LightTokenizer.apply_chat_template renders one conversation at a time")
        text = self.get_chat_template(None, tools)
        variables = {**self.special_tokens_map, **variables}
        messages = without_none(conversation)
        rendered = render(self._template(text), messages, tools, documents, add_generation_prompt, **variables)
        if not tokenize:
            return rendered
        ids = self.backend_tokenizer.encode(rendered, add_special_tokens=False).ids
        return {"input_ids": ids, "attention_mask": [1] * len(ids)} if return_dict else ids

    def _template(self, text: str) -> Any:
        if text not in self._compiled:
            self._compiled[text] = chat_environment().from_string(text)
        return self._compiled[text]


def _read(directory: Path) -> LightTokenizer:
    """The light tokenizer of `directory`; Refused naming what it does not reproduce."""
    _check_versions()
    config, model = _json(directory / "tokenizer_config.json"), _json(directory / "config.json", missing=None)
    if not takes_generic_class(config, model):
        raise Refused("not the generic fast class of a plain model type")
    spec_path = directory / "tokenizer.json"
    if not spec_path.is_file():
        raise Refused("no tokenizer.json")
    spec = _json(spec_path)
    if spec.get("truncation") is not None or spec.get("padding") is not None:
        raise Refused("tokenizer.json has truncation or padding set")
    _check_keys(config)
    backend = _backend(spec_path)
    special = _special_tokens(config)
    added = _added_tokens(directory, config, spec)
    extras = _extra_tokens(config)
    flags = {name: config.get(name, False) for name in FLAGS}
    backend.encode_special_tokens = flags["split_special_tokens"]
    _add_again(backend, added, _as_added(special, added), extras)
    if (model or {}).get("model_type") in MISTRAL_TYPES and backend.get_vocab_size() > 100_000:
        raise Refused("a Mistral-type tokenizer transformers may re-patch")
    if backend.post_processor is None:
        from tokenizers import processors

        backend.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1", special_tokens=[])
    template = _chat_template(directory, config)
    return LightTokenizer(backend, special, template, **flags, name_or_path=str(directory))


def _check_versions() -> None:
    try:
        installed = metadata.version("transformers")
    except metadata.PackageNotFoundError:
        installed = None
    if installed is None or installed.split(".")[0] != TRANSFORMERS_MAJOR:
        raise Refused(f"transformers {installed}, not {TRANSFORMERS_MAJOR}.x, whose loading rules this reproduces")
    if not jinja_supported():
        raise Refused("jinja2 older than 3.1.6")


def _json(path: Path, missing: Any = Refused) -> Any:
    """A JSON object file's content; `missing` where the file is absent (Refused if that is Refused)."""
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        if missing is Refused:
            raise Refused(f"no {path.name}") from None
        return missing
    except (OSError, ValueError):
        raise Refused(f"{path.name} unreadable") from None
    try:
        value = _parse(text)
    except ValueError:
        raise Refused(f"{path.name} is not JSON") from None
    if not isinstance(value, dict):
        raise Refused(f"{path.name} is not a JSON object")
    return value


def _parse(text: str) -> Any:
    """JSON text parsed by orjson (tokenizer.json is megabytes), or by the standard library where orjson cannot
    (integers past 64 bits, such as a model_max_length of 1e30)."""
    try:
        return orjson.loads(text)
    except orjson.JSONDecodeError:
        return json.loads(text)


def _check_keys(config: dict) -> None:
    """Refused unless every key of tokenizer_config.json is one whose effect is reproduced, with a plain value."""
    for key, value in config.items():
        if key in INERT_KEYS:
            continue
        if key in SPECIAL_TOKEN_NAMES:
            ok = value is None or isinstance(value, str)
        elif key in FLAGS:
            ok = isinstance(value, bool)
        elif key in SIDES:
            ok = value in ("left", "right")
        elif key in ("extra_special_tokens", "additional_special_tokens"):
            ok = value is None or (isinstance(value, list) and all(isinstance(t, str) for t in value))
        elif key == "added_tokens_decoder":
            ok = isinstance(value, dict) and all(isinstance(t, dict) for t in value.values())
        elif key == "chat_template":
            ok = _plain_template(value)
        else:
            ok = False
        if not ok:
            raise Refused(f"tokenizer_config.json key {key!r} = {str(value)[:60]!r}")


def _plain_template(value: Any) -> bool:
    """A template value of tokenizer_config.json that loads as text: a string, None, a list of named strings
    (`[{"name": ..., "template": ...}]`) or a dict of strings."""
    if value is None or isinstance(value, str):
        return True
    if isinstance(value, list):
        return all(isinstance(t, dict) and t.keys() == {"name", "template"} for t in value) and all(
            isinstance(t["name"], str) and isinstance(t["template"], str) for t in value
        )
    return isinstance(value, dict) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())


def _backend(path: Path) -> Any:
    from tokenizers import Tokenizer

    try:
        backend = Tokenizer.from_file(str(path))
    except Exception:  # noqa: BLE001 - a file the Rust reader rejects: transformers says why
        raise Refused("tokenizer.json does not load") from None
    backend.no_truncation()  # as transformers does: a no-op on a file without truncation
    return backend


def _special_tokens(config: dict) -> dict[str, str]:
    """The named special tokens, in transformers' order."""
    return {name: config[name] for name in SPECIAL_TOKEN_NAMES if config.get(name) is not None}


def _added_tokens(directory: Path, config: dict, spec: dict) -> list[tuple[int, Any]]:
    """(id, AddedToken) in file order, as transformers collects them: tokenizer_config.json's
    `added_tokens_decoder`, else (no legacy file allowed) tokenizer.json's `added_tokens`."""
    from tokenizers import AddedToken

    if "added_tokens_decoder" in config:
        entries = [(int(i), dict(t)) for i, t in config["added_tokens_decoder"].items() if _is_index(i)]
        if len(entries) != len(config["added_tokens_decoder"]):
            raise Refused("added_tokens_decoder has a key that is not an id")
    else:
        legacy = [name for name in LEGACY_FILES if (directory / name).exists()]
        if legacy:
            raise Refused(f"legacy {legacy[0]}")
        entries = [(t.get("id"), {k: v for k, v in t.items() if k != "id"}) for t in spec.get("added_tokens") or []]
    tokens = []
    for index, fields in entries:
        if not isinstance(index, int):
            raise Refused(f"added token id {index!r}")
        try:
            tokens.append((index, AddedToken(**fields)))
        except TypeError:
            raise Refused(f"added token {fields!r:.60} is not an AddedToken's fields") from None
    return tokens


def _is_index(key: str) -> bool:
    try:
        int(key)
    except ValueError:
        return False
    return True


def _extra_tokens(config: dict) -> list[str]:
    """`extra_special_tokens`, or `additional_special_tokens` (its old name) when the new one is empty."""
    if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
        return list(config["additional_special_tokens"] or [])
    return list(config.get("extra_special_tokens") or [])


def _as_added(special: dict[str, str], added: list[tuple[int, Any]]) -> dict[str, Any]:
    """Each named special token as the added token of the same text where there is one (the last in file order;
    transformers keeps its flags), else its text."""
    by_text = {str(token): token for _, token in added}
    return {name: by_text.get(value, value) for name, value in special.items()}


def _add_again(backend: Any, added: list[tuple[int, Any]], special: dict[str, Any], extras: list[str]) -> None:
    """Add the added tokens to the backend again (by id, the last of an id in file order), then the special and
    extra tokens missing from them, as transformers' `__init__` does: it re-adds every one, so their flags are
    the ones read here."""
    from tokenizers import AddedToken

    again = [token for _, token in sorted(dict(added).items(), key=lambda item: item[0])]
    present = [token.content for _, token in sorted(backend.get_added_tokens_decoder().items())]
    present += [str(token) for token in again]
    for token in [*special.values(), *extras]:
        if str(token) not in present and token not in again:
            again.append(token)
    if not again:
        return
    named = [str(token) for token in special.values() if token]
    tokens = []
    for token in again:
        if isinstance(token, str):
            token = AddedToken(token, special=True)
        elif not token.special and str(token) in named:
            token.special = True
        tokens.append(token)
    backend.add_tokens(tokens)


def _chat_template(directory: Path, config: dict) -> str | dict | None:
    """The chat template as transformers loads it: files first (one: its text; several: a dict by name), else
    tokenizer_config.json's (a list of named templates as a dict)."""
    files = {}
    if (directory / "chat_template.jinja").is_file():
        files["default"] = directory / "chat_template.jinja"
    extra = directory / TEMPLATE_DIR
    if extra.is_dir():
        for path in extra.glob("*.jinja"):
            name = path.name.removesuffix(".jinja")
            if not path.is_file() or name == "file":  # "file" would take chat_template.jinja's place in transformers
                raise Refused(f"{TEMPLATE_DIR}/{path.name}")
            files[name] = path
    templates = {name: _text(path) for name, path in files.items()}
    if templates:
        return templates["default"] if list(templates) == ["default"] else templates
    value = config.get("chat_template")
    if isinstance(value, list):
        return {t["name"]: t["template"] for t in value}
    return value


def _text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")  # universal newlines, as transformers' open() reads it
    except (OSError, ValueError):
        raise Refused(f"{path.name} unreadable") from None
