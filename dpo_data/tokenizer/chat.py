"""Chat templates rendered by transformers' rules in a Jinja environment of our own, without importing transformers.

transformers (5.x, `utils/chat_template_utils.py`) compiles a chat template in an immutable sandbox with
`trim_blocks` and `lstrip_blocks`, the `loopcontrols` extension and a `{% generation %}` tag, a `tojson` filter
that does not escape HTML, and the globals `raise_exception`, `strftime_now`, `dict` and `namespace`; it hands the
template plain data (`template_data`) and a message's reasoning under every name templates read
(`alias_reasoning`). `chat_environment` builds the same environment; tests/data/test_light_tokenizer.py holds the
two equal, option by option and rendering by rendering.
"""

from __future__ import annotations

import dataclasses
import json
import re
import sys
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import jinja2
from jinja2 import nodes
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.ext import Extension
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

OPTIONS = {"trim_blocks": True, "lstrip_blocks": True}
"""The environment's options that differ from Jinja's defaults."""
MIN_JINJA = (3, 1, 6)
"""transformers refuses older Jinja (known sandbox escapes), and so do we."""
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
"""The names a message's reasoning goes under; the first is the one templates read."""


class GenerationTag(Extension):
    """`{% generation %}...{% endgeneration %}`: marks the assistant's own text (transformers derives an
    assistant-token mask from it); it renders its body unchanged, which is all a rendering needs."""

    tags = {"generation"}

    def parse(self, parser: Any) -> nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Any) -> str:
        return caller()


class TemplateDict:
    """`dict` in a template: makes plain dicts (and `dict.fromkeys`) without handing the type itself over."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class TemplateNamespace(Namespace):
    """`namespace` in a template: Jinja's, refusing attribute names that start with an underscore."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - `self` stays free as an attribute name
        self, attributes = args[0], dict(*args[1:], **kwargs)
        for name in attributes:
            _check_name(name)
        Namespace.__init__(self, attributes)

    def __setitem__(self, name: str, value: Any) -> None:
        _check_name(name)
        Namespace.__setitem__(self, name, value)


def _check_name(name: Any) -> None:
    if isinstance(name, str) and name.startswith("_"):
        raise SecurityError(
            f"Chat templates cannot store underscore-prefixed attributes on a namespace, but got {name!r}. "
            "Please rename the attribute."
        )


def raise_exception(message: Any) -> None:
    """The template's own refusal: a TemplateError carrying its message."""
    raise TemplateError(message)


def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
    """`json.dumps` with these defaults (Jinja's own `tojson` escapes HTML characters)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format: str) -> str:  # noqa: A002 - the name templates pass it by
    return datetime.now().strftime(format)


def jinja_supported() -> bool:
    """Whether the installed Jinja is one transformers would render chat templates with."""
    found = re.match(r"(\d+)\.(\d+)\.(\d+)", jinja2.__version__)
    return found is not None and tuple(map(int, found.groups())) >= MIN_JINJA


def chat_environment(cls: type = ImmutableSandboxedEnvironment) -> Any:
    """A new environment of `cls` (the sandbox or a subclass) set up as transformers sets up its own."""
    if not jinja_supported():
        raise ImportError(
            "chat templates need jinja2>=3.1.6 (older versions have known sandbox escapes); found "
            f"{jinja2.__version__}: pip install -U jinja2"
        )
    env = cls(**OPTIONS, extensions=[GenerationTag, "jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(
        raise_exception=raise_exception, strftime_now=strftime_now, dict=TemplateDict(), namespace=TemplateNamespace
    )
    return env


def template_data(value: Any) -> Any:
    """`value` rebuilt from plain JSON types, as transformers hands everything to a template: exact scalars as they
    are, subclasses of str/int/float as the base type, mappings, lists and tuples item by item, numpy scalars as
    Python ones, dataclasses and pydantic models as dicts, anything else as a placeholder naming its type."""
    kind = type(value)
    if value is None or kind in (str, int, float, bool):
        return value
    if isinstance(value, str):  # subclasses (enums, numpy strings) carry methods the sandbox does not know
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {template_data(key): template_data(item) for key, item in value.items()}
    if isinstance(value, list):
        return [template_data(item) for item in value]
    if isinstance(value, tuple):
        return tuple(template_data(item) for item in value)
    numpy = sys.modules.get("numpy")  # a numpy scalar can only come from numpy, imported by whoever made it
    if numpy is not None and isinstance(value, numpy.generic):
        return template_data(value.item())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: template_data(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return template_data(value.model_dump())
    return f"<{kind.__name__}>"


def as_dicts(value: Any) -> Any:
    """Message objects (dataclasses, pydantic models) turned into dicts, everything else kept, as transformers does
    before it drops None values."""
    if isinstance(value, Mapping):
        return {key: as_dicts(item) for key, item in value.items()}
    if isinstance(value, list):
        return [as_dicts(item) for item in value]
    if isinstance(value, tuple):
        return tuple(as_dicts(item) for item in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {field.name: as_dicts(getattr(value, field.name)) for field in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return as_dicts(value.model_dump())
    return value


def without_none(messages: Any) -> list[dict]:
    """A conversation as dicts without the keys whose value is None (templates handle a missing key better)."""
    out = []
    for message in as_dicts(getattr(messages, "messages", messages)):
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
        out.append({key: value for key, value in message.items() if value is not None})
    return out


def alias_reasoning(messages: list) -> list:
    """Each message with reasoning (under any of `REASONING_FIELDS`) carries it as `reasoning_content` and
    `thinking` too: templates read one name or the other."""
    aliased = []
    for message in messages:
        if isinstance(message, dict):
            reasoning = next((message[key] for key in REASONING_FIELDS if message.get(key) is not None), None)
            if reasoning is not None:
                message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
        aliased.append(message)
    return aliased


def tool_schemas(tools: Any) -> list | None:
    """The tools a template sees: JSON schemas only (transformers also converts Python functions; rows hold none)."""
    if tools is None:
        return None
    for tool in tools:
        if not isinstance(tool, dict):
            raise ValueError("Tools should be JSON schemas (dicts) when the tokenizer is read without transformers.")
    return list(tools)


def render(template: Any, messages: list, tools: Any, documents: Any, add_generation_prompt: bool, **variables: Any):
    """`template` rendered with what transformers passes it: the messages (None values already dropped), tools,
    documents, the generation flag and the variables (the special-token map and any others), all as plain data."""
    if documents is not None and not all(isinstance(document, dict) for document in documents):
        raise TypeError("Documents should be a list of dicts with 'title' and 'text' keys!")
    chat = template_data(messages)
    for message in chat:
        if not isinstance(message, dict):
            raise TypeError(f"Chat messages should be dicts, dataclasses or pydantic models, but got {message!r}.")
    return template.render(
        messages=alias_reasoning(chat),
        tools=template_data(tool_schemas(tools)),
        documents=template_data(documents),
        add_generation_prompt=add_generation_prompt,
        **template_data(variables),
    )
