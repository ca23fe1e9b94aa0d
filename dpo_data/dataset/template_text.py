"""Which tokens of a stored pair the chat template (or the build) added, and which came from the row's own text."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

TEMPLATE, TEXT, IMAGE = "template", "text", "image"
"""A token's origin: the chat template's or the build's own text (special tokens always), the row's message
content, or an image placeholder the processor expanded."""
MAX_MESSAGES = 64
"""The longest prompt conversation tried against the template's skeleton; a longer one is marked by its special
tokens alone."""
_SENTINEL = "\ue000DPO{}\ue001"  # private-use code points: never in a real template's own text
_SENTINEL_RE = re.compile("\ue000DPO(\\d+)\ue001")


def token_pieces(backend: Any, ids: list[int]) -> list[str]:
    """Each token's share of the decoded text, in order, special tokens included; joined, they are the decoded
    sequence. A token ending inside a character (byte-level BPE splits UTF-8) gets "", and the character goes to the
    token that completes it. Decoded in a sliding window, as streaming detokenizers do, so that a token's leading
    space (SentencePiece) and split bytes come out as in the whole sequence's decoding."""
    pieces, start, read = [], 0, 0
    for k in range(len(ids)):
        before = backend.decode(ids[start:read], skip_special_tokens=False)
        after = backend.decode(ids[start : k + 1], skip_special_tokens=False)
        if len(after) > len(before) and not after.endswith("\ufffd"):
            pieces.append(after[len(before) :])
            start, read = read, k + 1
        else:
            pieces.append("")
    if read < len(ids):  # bytes that never complete a character: the last token shows what they decode to
        before = backend.decode(ids[start:read], skip_special_tokens=False)
        pieces[-1] = backend.decode(ids[start:], skip_special_tokens=False)[len(before) :]
    return pieces


class TemplateSkeleton:
    """The chat template's own text around a conversation's messages, rendered once per role sequence with
    placeholder contents. A pair's decoded prompt matched against it tells the template's characters (a default
    system prompt, role headers) from the row's message contents, without the row."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        self._skeletons: dict[tuple, list[str] | None] = {}

    def prompt_content(self, text: str) -> tuple[tuple, list] | None:
        """(roles, content spans) of the prompt conversation that renders as `text`, or None when none does.

        Of the role sequences that match (user and assistant turns in alternation, ending with the user's, with or
        without a system message first), the one leaving the least text to the contents wins: a system message
        would also match a template's default system prompt as its content, one user turn would match a whole
        conversation, its inner turn markers taken for content. Special tokens inside a content span (a vision
        prompt's image markers, which the processor adds around its placeholders) stay the template's: `origins`
        marks them so."""
        best = None
        for candidates in _role_sequences():
            entries = [(roles, self._skeleton(roles, generation=True)) for roles in candidates]
            entries = [(roles, literals) for roles, literals in entries if literals is not None]
            if entries and all(sum(map(len, literals)) > len(text) for _, literals in entries):
                break  # the template's own text alone is longer than the prompt, and grows with the turns
            for roles, literals in entries:
                spans = _match(literals, text)
                if spans is None:
                    continue
                size = sum(e - s for s, e in spans)
                if best is None or size < best[0]:
                    best = (size, roles, spans)
        return None if best is None else best[1:]

    def completion_content(self, roles: tuple, text: str) -> list | None:
        """The content span of an assistant reply to conversation `roles` rendered as `text`, or None."""
        literals = self._skeleton((*roles, "assistant"), generation=False, after=roles)
        return None if literals is None else _match(literals, text)

    def _skeleton(self, roles: tuple, generation: bool, after: tuple | None = None) -> list[str] | None:
        """The template's text around each message of `roles` (past the rendering of `after` with the generation
        prompt): one more piece than messages; None where the template refuses the shape."""
        key = (roles, generation, after)
        if key not in self._skeletons:
            rendered = self._render(roles, generation)
            if rendered is not None and after is not None:
                head = self._render(after, True)
                rendered = rendered[len(head) :] if head is not None and rendered.startswith(head) else None
            first = 0 if after is None else len(after)
            self._skeletons[key] = None if rendered is None else _literals(rendered, range(first, len(roles)))
        return self._skeletons[key]

    def _render(self, roles: tuple, generation: bool) -> str | None:
        messages = [{"role": role, "content": _SENTINEL.format(i)} for i, role in enumerate(roles)]
        try:
            return self.tokenizer.apply_chat_template(messages, add_generation_prompt=generation, tokenize=False)
        except Exception:  # noqa: BLE001 - a template may refuse a shape (roles must alternate...): not this one
            return None


def origins(
    ids: list[int], pieces: list[str], content: list | None, special_ids: frozenset[int], image_token: int | None
) -> list[str]:
    """Each token's origin: IMAGE for the image placeholder, TEMPLATE for a special token or (when `content` is
    known) one with no character in a content span, else TEXT. With `content` None only special tokens are known to
    be the template's."""
    out, at = [], 0
    for token, piece in zip(ids, pieces):
        span = (at, at + len(piece))
        at = span[1]
        if token == image_token:
            out.append(IMAGE)
        elif token in special_ids or (content is not None and not _overlaps(span, content)):
            out.append(TEMPLATE)
        else:
            out.append(TEXT)
    return out


def _literals(rendered: str, messages: range) -> list[str] | None:
    """The template's text between the placeholder contents of `rendered`, or None unless each of `messages` is
    rendered once, in order (a template that drops, repeats or reorders a message has no skeleton to match)."""
    split = _SENTINEL_RE.split(rendered)
    if [int(n) for n in split[1::2]] != list(messages):
        return None
    return split[::2]


def _match(literals: list[str], text: str) -> list[tuple[int, int]] | None:
    """The content spans of `text` read as `literals` with a message's content between each two, or None: each
    content ends at the first place its next literal follows (a content quoting the template's own text is cut
    there). Linear in the text, where a backtracking regex of many lazy groups is exponential on a near miss."""
    first, *middle, last = literals
    if not text.startswith(first) or len(text) < len(first) + len(last):
        return None
    spans, at = [], len(first)
    for literal in middle:
        end = text.find(literal, at)
        if end < 0:
            return None
        spans.append((at, end))
        at = end + len(literal)
    end = len(text) - len(last)
    if end < at or not text.endswith(last):
        return None
    return [*spans, (at, end)]


def _role_sequences() -> Iterator[tuple[tuple, tuple]]:
    """User and assistant turns in alternation ending with the user's, shortest first, each alone and after a system
    message: the prompts a preference row renders."""
    for n in range(1, MAX_MESSAGES, 2):
        turns = tuple("user" if i % 2 == 0 else "assistant" for i in range(n))
        yield turns, ("system", *turns)


def _overlaps(span: tuple[int, int], spans: list) -> bool:
    """Whether `span` shares a character with one of `spans`; an empty span (a token ending inside a character)
    counts where its position falls."""
    start, end = span
    if start == end:
        return any(s <= start < e for s, e in spans)
    return any(start < e and s < end for s, e in spans)
