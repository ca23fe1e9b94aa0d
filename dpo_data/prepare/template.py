"""Render chat templates exactly as `apply_chat_template` does, without its per-call overhead; read an override."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dpo_data.errors import DataError
from dpo_state.digest import bytes_digest

_PLAIN_KEYS = frozenset(("role", "content"))


class ChatRenderer:
    """`render(messages, add_generation_prompt, tools)` == `tokenizer.apply_chat_template(..., tokenize=False)`.

    transformers spends most of a call normalizing and copying the conversation (for objects, media,
    reasoning aliases and None values). Messages that are plain `{"role": str, "content": str}` dicts
    need none of it, so for them the compiled template is rendered directly with the variables
    transformers passes (messages, tools, documents, add_generation_prompt, the special-token map).
    Anything else (tool calls, other message keys, a `tools` list) goes through `apply_chat_template` itself.
    tests/test_template.py pins the equality.
    """

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._compiled = _compile(tokenizer.chat_template)
        self._variables = dict(tokenizer.special_tokens_map)

    def render(self, messages: list[dict], add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
        if tools is None and self._compiled is not None and all(m.keys() == _PLAIN_KEYS for m in messages):
            return self._compiled.render(
                messages=messages,
                tools=None,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._variables,
            )
        return self.tokenizer.apply_chat_template(
            messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
        )


def _compile(template: Any) -> Any:
    """transformers' own compiled template (same sandbox and globals), or None to always fall back."""
    if not isinstance(template, str):
        return None  # no template, or named templates: let transformers choose and raise
    try:
        from transformers.utils.chat_template_utils import _compile_jinja_template
    except ImportError:  # a transformers without this helper: correctness first, speed second
        return None
    return _compile_jinja_template(template)


def read_chat_template(path: str | Path) -> dict:
    """`--chat-template FILE` as the manifest records it: `{"file": name, "sha256": "sha256:<hex>", "text": ...}`.

    A file that cannot be read, is not UTF-8, is blank or does not compile as a Jinja template (with
    transformers' own environment) is a DataError naming the file and the fix."""
    path = Path(path)
    fix = "pass a chat template file (Jinja text, as in a tokenizer's chat_template.jinja)"
    try:
        data = path.read_bytes()
    except OSError as e:
        raise DataError(f"--chat-template {path}: cannot read it ({e.strerror or e}); {fix}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise DataError(f"--chat-template {path}: not UTF-8 text (byte {e.start}); {fix}") from None
    if not text.strip():
        raise DataError(f"--chat-template {path}: the file is empty; {fix}")
    _check_compiles(path, text, fix)
    return {"file": path.name, "sha256": bytes_digest(data), "text": text}


def _check_compiles(path: Path, text: str, fix: str) -> None:
    from jinja2 import TemplateError
    from transformers.utils.chat_template_utils import _compile_jinja_template

    try:
        _compile_jinja_template(text)
    except TemplateError as e:
        line = f" line {e.lineno}" if getattr(e, "lineno", None) else ""
        raise DataError(f"--chat-template {path}: not a valid Jinja template ({e.message}{line}); {fix}") from None
