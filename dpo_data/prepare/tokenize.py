"""The tokenization contract: prompt and completion ids per pair, prefix-checked, never guessed or silently cut."""

from __future__ import annotations

import functools
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dpo_data.errors import DataError
from dpo_data.prepare.inputs import MAX_ROW_BYTES
from dpo_data.prepare.rows import Pair, RowReject
from dpo_data.prepare.shared_head import SpecialSplit
from dpo_data.prepare.template import FAIL_FAST_ROWS, TEMPLATE_FAILURES, ChatRenderer, render_chars, unrenderable

OVERLENGTH_MODES = ("reject", "truncate-prompt")
_TAILS_KEPT = 64  # distinct prompt tails (text after the prompt's last special token) kept encoded
_SENTINEL = "\ue000DPO{}\ue001"  # private-use code points: never in a real template's own text


@dataclass(frozen=True)
class TokenizeOptions:
    """How pairs become ids; part of the build options recorded in the manifest."""

    max_length: int | None = None
    overlength: str = "reject"
    append_eos: bool = True
    max_row_bytes: int = MAX_ROW_BYTES
    """The largest row read: a rendering may hold `render_chars(max_row_bytes)` characters."""


@dataclass(frozen=True)
class EncodedPair:
    """Token ids of one pair: the prompt once, then each completion (which includes its end-of-turn token)."""

    prompt: list[int]
    chosen: list[int]
    rejected: list[int]
    truncated_prompt_tokens: int = 0
    images: tuple = ()
    """A vision pair's images as (bytes, hex sha256), in placeholder order."""


class PairEncoder:
    """Encodes validated pairs with one tokenizer under `TokenizeOptions`.

    Conversations: prompt = chat template over the history with the generation prompt; completion =
    what follows it in the template over history + completion. The prompt ids must be an exact prefix
    of both full renderings (text and ids), else the row is rejected as not prefix-stable.
    Plain text: prompt and completion are encoded separately and joined (no BPE merge across the join),
    plus EOS on each completion. Special-token text inside content is encoded as ordinary text.
    Tool calls and a row's `tools` are rendered by the template as TRL renders them, or the row is rejected
    where the template would drop them (it renders the same without them).
    All of a row's renderings share one budget (template.py); a row over it is rejected as `template_budget`.
    With `override` (the --chat-template file), a template that fails on the first `FAIL_FAST_ROWS` rows it
    meets, rendering none, stops the build with a DataError instead of failing on every row in turn.
    """

    def __init__(self, tokenizer: Any, options: TokenizeOptions, override: Any = None):
        self.tokenizer = tokenizer
        self.options = options
        self._renderer = ChatRenderer(tokenizer, render_chars(options.max_row_bytes))
        self._override = override
        self.rendered_rows = 0
        """Rows whose renderings the chat template made (kept or rejected later)."""
        self._failed_rows = 0
        backend = tokenizer.backend_tokenizer
        # Copies of the Rust tokenizer, because encode_special_tokens is state on the object (and to_str drops
        # it): this one encodes template text as the tokenizer does (special tokens matched, or split into
        # plain text under the tokenizer's split_special_tokens), `_content` never matches them (user content).
        # Serializing the backend is a large part of start-up, so it is done once.
        self._spec = backend.to_str()
        self._template = _as_text_gives(type(backend).from_str(self._spec))
        splits = bool(getattr(tokenizer, "split_special_tokens", False))
        self._template.encode_special_tokens = splits
        self._split = SpecialSplit(tokenizer, self._template, self._spec)
        self._tails: dict[str, list[int]] = {}
        specials = sorted(
            {t.content for t in tokenizer.added_tokens_decoder.values() if t.special}, key=len, reverse=True
        )
        # special-token text anywhere is plain text to a tokenizer that splits special tokens: nothing to keep apart
        self._special_re = re.compile("|".join(map(re.escape, specials))) if specials and not splits else None
        self._eos = tokenizer.eos_token_id
        # A template whose source never names tool_calls cannot render them; checked before rendering because
        # such a template often fails on a tool call's missing content, which would hide the real reason.
        self._reads_tool_calls = _template_mentions(tokenizer.chat_template, "tool_calls")
        if options.append_eos and self._eos is None:
            raise DataError(
                "--tokenizer: the tokenizer has no eos_token, and plain-text completions end with EOS; "
                "pass --no-eos or use a tokenizer with an eos_token"
            )

    @functools.cached_property
    def _content(self) -> Any:
        """The copy that encodes special-token text as plain text; only plain-text pairs and content holding
        special-token text need it, so it is made on first use."""
        content = _as_text_gives(type(self._template).from_str(self._spec))
        content.encode_special_tokens = True
        return content

    def encode_many(self, pairs: Sequence[Pair]) -> list[EncodedPair | RowReject]:
        """Encode pairs in order; each result is an `EncodedPair` or the `RowReject` that stopped it."""
        results: list[Any] = [None] * len(pairs)
        fast: list[tuple[int, tuple[str, str, str]]] = []
        pieces: list[tuple[int, list]] = []
        for i, pair in enumerate(pairs):
            try:
                if pair.kind == "text":
                    results[i] = self._finish(*self._encode_text(pair))
                    continue
                with self._renderer.row():  # one budget for all of the row's renderings; encoding comes after
                    if self._has_control_text(pair):
                        pieces.append((i, self._render_piecewise(pair)))
                    else:
                        fast.append((i, self._render(pair)))
            except RowReject as reject:
                results[i] = reject
                self._count_failure(reject)
        for i, parts in pieces:
            try:
                results[i] = self._finish(*self._split_prefix(*(self._encode_pieces(*part) for part in parts)))
            except RowReject as reject:
                results[i] = reject
        if fast:
            for (i, _), encoded in zip(fast, self._encode_rendered([rendered for _, rendered in fast])):
                try:
                    results[i] = self._finish(*self._split_tails(*encoded))
                except RowReject as reject:
                    results[i] = reject
        return results

    def _encode_rendered(self, rendered: list[tuple[str, str, str]]) -> list[tuple[list[int], ...]]:
        """Ids of (prompt, prompt + chosen, prompt + rejected) renderings, batch-encoded, as (head, chosen
        tail, rejected tail, prompt tail): the prompt is head + prompt tail, each full rendering head + its tail.

        The three share the prompt's text up to its last special token (checked as text by `_render`);
        that head is encoded once (see shared_head.py for why this is exact). What follows it in the prompt
        is the generation prompt, the same text in nearly every row, so each distinct tail is encoded once.
        """
        cuts = [self._split.boundary(p) for p, _, _ in rendered]
        texts = []
        for (p, c, r), b in zip(rendered, cuts):
            texts += (p[:b], c[b:], r[b:])
        new_tails = list({p[b:] for (p, _, _), b in zip(rendered, cuts)} - self._tails.keys())
        ids = [e.ids for e in self._template.encode_batch_fast(texts + new_tails, add_special_tokens=False)]
        tails = dict(zip(new_tails, ids[len(texts) :]))
        if len(self._tails) < _TAILS_KEPT:  # kept across chunks; a tokenizer without a split point has a
            self._tails.update(tails)  # tail per prompt (the whole prompt), which is not worth keeping
        tails.update(self._tails)
        return [(*ids[3 * k : 3 * k + 3], tails[p[b:]]) for k, ((p, _, _), b) in enumerate(zip(rendered, cuts))]

    # -- conversations -------------------------------------------------------------------------

    def _render(self, pair: Pair) -> tuple[str, str, str]:
        plain = _is_plain(pair)
        if not plain:
            self._check_tool_fields(pair)
        render = self._renderer.render
        prompt = render(pair.prompt, True, pair.tools)
        chosen = render(pair.prompt + pair.chosen, False, pair.tools)
        rejected = render(pair.prompt + pair.rejected, False, pair.tools)
        self.rendered_rows += 1
        if not plain:
            self._check_tools_rendered(pair, prompt, chosen, rejected)
        for field, full in (("chosen", chosen), ("rejected", rejected)):
            if not full.startswith(prompt):
                raise RowReject(
                    "template_not_prefix_stable",
                    f"the chat template renders the prompt differently alone than before the {field} completion "
                    f"(prompt ends {prompt[-40:]!r}, "
                    f"full rendering has {full[len(prompt) - 40 : len(prompt)]!r} there)",
                )
        return prompt, chosen, rejected

    def _count_failure(self, reject: RowReject) -> None:
        """A row the template failed on; with an override that has rendered nothing yet, the last one allowed."""
        if reject.reason not in TEMPLATE_FAILURES:
            return
        self._failed_rows += 1
        if self._override is not None and not self.rendered_rows and self._failed_rows >= FAIL_FAST_ROWS:
            what = f"the first {self._failed_rows} rows that reached it all failed, so the build stopped there"
            raise unrenderable(self._override, what, reject.message)

    def _split_tails(self, head: list[int], chosen: list[int], rejected: list[int], tail: list[int]):
        """`_split_prefix` for renderings encoded as a shared head and tails: only the tails are compared."""
        n = len(tail)
        for field, full in (("chosen", chosen), ("rejected", rejected)):
            if full[:n] != tail:
                self._not_a_prefix(field, head + tail, head + full)
        return head + tail, chosen[n:], rejected[n:]

    def _split_prefix(self, prompt: list[int], chosen: list[int], rejected: list[int]):
        n = len(prompt)
        for field, full in (("chosen", chosen), ("rejected", rejected)):
            if full[:n] != prompt:
                self._not_a_prefix(field, prompt, full)
        return prompt, chosen[n:], rejected[n:]

    @staticmethod
    def _not_a_prefix(field: str, prompt: list[int], full: list[int]) -> None:
        at = next((j for j, (a, b) in enumerate(zip(prompt, full)) if a != b), min(len(prompt), len(full)))
        raise RowReject(
            "template_not_prefix_stable",
            f"the prompt's {len(prompt)} tokens are not a prefix of the tokenized prompt + {field}: they differ at "
            f"token {at} (tokens merge across the prompt/completion boundary)",
        )

    def _has_control_text(self, pair: Pair) -> bool:
        if self._special_re is None:
            return False
        messages = (*pair.prompt, *pair.chosen, *pair.rejected)
        return any(self._special_re.search(m.get("content", "")) for m in messages)

    def _render_piecewise(self, pair: Pair) -> list[tuple[list[str], list[str]]]:
        """For rows whose content holds special-token text: the (template texts, contents) of the prompt, prompt +
        chosen and prompt + rejected, to encode template text with special tokens and content without. The
        template is rendered around sentinels to find where content goes."""
        self._render(pair)  # the same prefix-stability check on the real text
        return [
            self._pieces(pair.prompt, True, pair.tools),
            self._pieces(pair.prompt + pair.chosen, False, pair.tools),
            self._pieces(pair.prompt + pair.rejected, False, pair.tools),
        ]

    def _pieces(self, messages: list, add_generation_prompt: bool, tools: list | None) -> tuple[list[str], list[str]]:
        # a tool call's message may have no content: it gets none, or the template would render an empty one
        marked = [{**m, "content": _SENTINEL.format(i)} if "content" in m else m for i, m in enumerate(messages)]
        rendered = self._renderer.render(marked, add_generation_prompt, tools)
        parts = re.split("\ue000DPO(\\d+)\ue001", rendered)
        real = self._renderer.render(messages, add_generation_prompt, tools)
        contents = [messages[int(j)]["content"] for j in parts[1::2]]
        if "".join(p for pair in zip(parts[0::2], contents + [""]) for p in pair) != real:
            raise RowReject(
                "template_error",
                "the chat template changes message content, so special-token text in content cannot be "
                "kept as plain text; remove the special-token text from the content",
            )
        return parts[0::2], contents

    def _encode_pieces(self, template_texts: list[str], contents: list[str]) -> list[int]:
        ids: list[int] = []
        for k, template_text in enumerate(template_texts):
            if template_text:
                ids += self._template.encode(template_text, add_special_tokens=False).ids
            if k < len(contents) and contents[k]:
                ids += self._content.encode(contents[k], add_special_tokens=False).ids
        return ids

    # -- tool calls and tools ------------------------------------------------------------------

    def _check_tool_fields(self, pair: Pair) -> None:
        """Before rendering: tool calls need a template that reads them; special-token text must not be where the
        template writes it as its own text (tool calls, tools, keys other than content), since only content is
        encoded apart as plain text and elsewhere it would become the token."""
        messages = [
            (f"{field}[{i}]", m)
            for field in ("prompt", "chosen", "rejected")
            for i, m in enumerate(getattr(pair, field))
        ]
        for where, message in messages:
            if message.get("tool_calls") and not self._reads_tool_calls:
                raise RowReject(
                    "tool_calls_not_rendered",
                    f"{where} has tool_calls, but the chat template never reads 'tool_calls', so they would be "
                    "dropped; use a tokenizer whose chat template renders tool calls, or remove them",
                )
        if self._special_re is None:
            return
        fields = [(f"{w}.{k}", v) for w, m in messages for k, v in m.items() if k not in ("role", "content")]
        for where, value in [*fields, ("tools", pair.tools)]:
            found = _special_text(self._special_re, value)
            if found:
                raise RowReject(
                    "control_text_outside_content",
                    f"{where} holds the special-token text {found!r}; the chat template writes it as its own text, "
                    "where it becomes that token (only message content is kept as plain text); remove it",
                )

    def _check_tools_rendered(self, pair: Pair, prompt: str, chosen: str, rejected: str) -> None:
        """After rendering: the tools and every tool call must change the rendering (else the template drops them)."""
        tools = pair.tools
        if tools and not self._differs(pair.prompt, True, None, prompt):
            raise RowReject(
                "tools_not_rendered",
                f"the chat template renders the prompt the same with and without the row's {len(tools)} tools, so "
                "they would be dropped; use a tokenizer whose chat template renders tools, or drop 'tools'",
            )
        self._check_calls_rendered("prompt", [], pair.prompt, prompt, True, tools)
        self._check_calls_rendered("chosen", pair.prompt, pair.chosen, chosen, False, tools)
        self._check_calls_rendered("rejected", pair.prompt, pair.rejected, rejected, False, tools)

    def _check_calls_rendered(
        self, field: str, history: list, part: list, rendered: str, add_generation_prompt: bool, tools: list | None
    ) -> None:
        """Each message of `part` with tool calls must render differently without them (a template may skip
        them in some positions, e.g. in the history)."""
        messages = history + part
        for i, message in enumerate(part):
            if not message.get("tool_calls"):
                continue
            without = {k: v for k, v in message.items() if k != "tool_calls"}
            k = len(history) + i
            if not self._differs(messages[:k] + [without] + messages[k + 1 :], add_generation_prompt, tools, rendered):
                raise RowReject(
                    "tool_calls_not_rendered",
                    f"the chat template renders {field}[{i}] the same with and without its tool_calls, so they "
                    "would be dropped; use a tokenizer whose chat template renders tool calls, or remove them",
                )

    def _differs(self, messages: list, add_generation_prompt: bool, tools: list | None, rendered: str) -> bool:
        """Whether `messages` render other than `rendered`; a template that fails without the tool data needs it
        (one over its budget without it rejects the row)."""
        try:
            return self._renderer.render(messages, add_generation_prompt, tools) != rendered
        except RowReject as reject:
            if reject.reason != "template_error":
                raise
            return True

    # -- plain text ----------------------------------------------------------------------------

    def _encode_text(self, pair: Pair):
        prompt = self._content.encode(pair.prompt, add_special_tokens=True).ids
        chosen, rejected = (self._content.encode(t, add_special_tokens=False).ids for t in (pair.chosen, pair.rejected))
        if self.options.append_eos:
            chosen, rejected = chosen + [self._eos], rejected + [self._eos]
        return prompt, chosen, rejected

    # -- length bound --------------------------------------------------------------------------

    def _finish(self, prompt: list[int], chosen: list[int], rejected: list[int]) -> EncodedPair:
        for field, ids in (("chosen", chosen), ("rejected", rejected)):
            if not ids:
                raise RowReject("empty_completion", f"the {field} completion encodes to no tokens")
        limit = self.options.max_length
        longest = max(len(chosen), len(rejected))
        if limit is None or len(prompt) + longest <= limit:
            return EncodedPair(prompt, chosen, rejected)
        if longest >= limit:
            raise RowReject(
                "completion_too_long",
                f"a completion has {longest} tokens, and --max-length {limit} leaves no room for even one "
                f"prompt token; completions are never truncated: raise --max-length or drop the row",
            )
        if self.options.overlength == "reject":
            raise RowReject(
                "too_long",
                f"prompt ({len(prompt)}) + longest completion ({longest}) = {len(prompt) + longest} tokens "
                f"exceeds --max-length {limit}; raise it or pass --overlength truncate-prompt",
            )
        keep = limit - longest
        return EncodedPair(prompt[-keep:], chosen, rejected, truncated_prompt_tokens=len(prompt) - keep)


def _is_plain(pair: Pair) -> bool:
    """No tools and only {role, content} messages: nothing for the tool checks (the common case, kept cheap)."""
    parts = (pair.prompt, pair.chosen, pair.rejected)
    return pair.tools is None and all(len(m) == 2 and "content" in m for part in parts for m in part)


def _template_mentions(template: Any, name: str) -> bool:
    """Whether the chat template's source (or any of its named templates) contains `name`."""
    if isinstance(template, dict):
        return any(_template_mentions(t, name) for t in template.values())
    return isinstance(template, str) and name in template


def _special_text(pattern: re.Pattern, value: Any) -> str | None:
    """The first special-token text in any string (or object key) inside `value`, else None."""
    if isinstance(value, str):
        match = pattern.search(value)
        return match.group() if match else None
    items = [*value.keys(), *value.values()] if isinstance(value, dict) else value if isinstance(value, list) else []
    return next((found for item in items if (found := _special_text(pattern, item))), None)


def _as_text_gives(backend: Any) -> Any:
    """`backend` with any truncation or padding its tokenizer.json saved switched off: the ids are what the
    tokenizer gives for the text, as transformers' own calls give them (it switches both off unless asked), never
    a prompt cut to a saved length or a sequence padded with pad ids. The attestation leaves those settings out
    because they change no id here."""
    backend.no_truncation()
    backend.no_padding()
    return backend
