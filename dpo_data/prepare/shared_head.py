"""Encode a shared rendered head once: a tokenizer's encoding splits exactly at a plain special token.

A Rust tokenizer first cuts the text at added tokens that are not normalized (leftmost-longest), then
normalizes, pre-tokenizes and BPE-encodes every piece on its own. So if position b ends such a match,
encode(text) == encode(text[:b]) + encode(text[b:]). For a prompt and its two full renderings, which
share everything up to the last special token of the prompt, the head is encoded once and only the
tails are encoded three times: as many tokens as rendering and encoding prompt and completions apart.

The rule is used only where it provably holds: boundary tokens that are special, not normalized, with
no lstrip / rstrip / single_word, matched at all (not under split_special_tokens, where they are plain text),
and no position-dependent pre-tokenization ("prepend_scheme": "first"). A self-check at construction compares
it with whole-text encoding and disables it on any difference. tests/data/test_tokenize.py compares it with
whole-text encoding on every row it covers.
"""

from __future__ import annotations

import re
from typing import Any

import orjson

_PROBES = [
    "plain text with no special token at all",
    "{special}",
    "head{special}tail  with spaces \n\n and newlines{special}\n",
    "{special}{special}x",
]


def _mentions_first(*parts: Any) -> bool:
    """Whether any component (nested in Sequence steps) has prepend_scheme "first"."""
    stack = list(parts)
    while stack:
        part = stack.pop()
        if isinstance(part, dict):
            if part.get("prepend_scheme") == "first":
                return True
            stack += list(part.values())
        elif isinstance(part, list):
            stack += part
    return False


class SpecialSplit:
    """`boundary(text)`: the end of the last provable split point in `text`, or 0 when there is none."""

    def __init__(self, tokenizer: Any, backend: Any, spec_json: str | None = None):
        """`spec_json`: `backend.to_str()` when the caller has it already (it is large to serialize)."""
        self.enabled = False
        if backend.encode_special_tokens:
            return  # special tokens encoded as plain text (split_special_tokens): no text is cut at them
        spec = orjson.loads(spec_json if spec_json is not None else backend.to_str())
        if _mentions_first(spec.get("normalizer"), spec.get("pre_tokenizer")):
            return  # Metaspace(prepend_scheme="first") treats a text's first piece apart
        added = list(tokenizer.added_tokens_decoder.values())
        matchable = sorted({t.content for t in added if not t.normalized}, key=len, reverse=True)
        safe = {
            t.content
            for t in added
            if t.special and not t.normalized and not t.lstrip and not t.rstrip and not t.single_word
        }
        if not safe:
            return
        # Leftmost, and at one start the longest first: the order in which the tokenizer matches.
        self._matcher = re.compile("|".join(map(re.escape, matchable)))
        self._safe = safe
        self.enabled = self._self_check(backend, sorted(safe))

    def boundary(self, text: str) -> int:
        if not self.enabled:
            return 0
        end = 0
        for match in self._matcher.finditer(text):
            if match.group() in self._safe:
                end = match.end()
        return end

    def _self_check(self, backend: Any, safe: list[str]) -> bool:
        self.enabled = True
        for special in safe[:4]:
            for probe in _PROBES:
                text = probe.format(special=special)
                b = self.boundary(text)
                whole = backend.encode(text, add_special_tokens=False).ids
                parts = (
                    backend.encode(text[:b], add_special_tokens=False).ids
                    + backend.encode(text[b:], add_special_tokens=False).ids
                )
                if whole != parts:
                    return False
        return True
