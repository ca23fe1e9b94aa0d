"""The fast chat-template path renders exactly what `apply_chat_template` renders."""

from __future__ import annotations

import copy

import pytest

from dpo_data.prepare.template import ChatRenderer

CONVERSATIONS = [
    [{"role": "user", "content": "hi"}],
    [{"role": "system", "content": ""}, {"role": "user", "content": "  spaced  "}],
    [
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4"},
        {"role": "user", "content": "héllo\n\n日本 🙂 <|im_end|>"},
    ],
    [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": "call"},
        {"role": "tool", "content": '{"x": 1}'},
        {"role": "assistant", "content": "done"},
    ],
]


@pytest.mark.parametrize("messages", CONVERSATIONS)
@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_fast_render_equals_apply_chat_template(tokenizer, messages, add_generation_prompt):
    expected = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)
    assert ChatRenderer(tokenizer).render(messages, add_generation_prompt) == expected


def test_templates_reading_special_token_variables_render_the_same(tokenizer):
    clone = copy.deepcopy(tokenizer)
    clone.chat_template = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}{{ eos_token }}{% endfor %}"
    messages = CONVERSATIONS[2]
    assert ChatRenderer(clone).render(messages, False) == clone.apply_chat_template(messages, tokenize=False)


def test_messages_with_extra_keys_take_the_transformers_path(tokenizer, monkeypatch):
    renderer = ChatRenderer(tokenizer)
    calls = []
    monkeypatch.setattr(tokenizer, "apply_chat_template", lambda *a, **k: calls.append(a) or "via transformers")
    assert renderer.render([{"role": "user", "content": "q", "reasoning_content": None}], True) == "via transformers"
    assert renderer.render([{"role": "user", "content": "q"}], True) != "via transformers"
    assert len(calls) == 1
