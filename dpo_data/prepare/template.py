"""Render chat templates exactly as `apply_chat_template` does, without its per-call overhead."""

from __future__ import annotations

from typing import Any

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
