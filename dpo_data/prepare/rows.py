"""Normalize one raw row into a preference pair (explicit or implicit prompt, text or conversation) or reject it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import orjson

ROLES = ("system", "user", "assistant", "tool")
FORMS = ("explicit-text", "explicit-chat", "whole-conversations", "implicit-chat", "implicit-text")
"""The row forms a pair can come from (docs/data-build.md, row formats); the manifest counts each input's pairs by
form."""
ASSISTANT_TURN = "\n\nAssistant:"
"""Where an assistant turn starts in Anthropic HH-RLHF's plain text (`\\n\\nHuman: ...\\n\\nAssistant: ...`)."""
HUMAN_TURN = "\n\nHuman:"


class RowReject(Exception):
    """A row that cannot become a pair: a documented reason code (docs/data-build.md) and a message."""

    def __init__(self, reason: str, message: str):
        super().__init__(message)
        self.reason = reason
        self.message = message


@dataclass(frozen=True)
class Pair:
    """A validated pair. For kind 'chat' the three parts are message lists, for 'text' strings; `tools` is the
    row's tool list (chat only), passed to the chat template as TRL passes it."""

    kind: str
    prompt: Any
    chosen: Any
    rejected: Any
    source: str | None
    id: str | None
    tools: list[dict] | None = None
    form: str = "explicit-text"
    """The row form it was read from (`FORMS`)."""
    images: tuple = ()
    """The row's `images` as given (paths, `{"bytes", "path"}` values or bytes), in placeholder order; read and
    checked by `dpo_data.prepare.vision`, which needs the input's directory."""

    @property
    def vision(self) -> bool:
        """Whether the pair needs a processor: it has images, or content given as parts."""
        return bool(self.images) or (self.kind == "chat" and any(_has_parts(m) for m in self.messages()))

    def messages(self) -> list[dict]:
        """Every message of a conversational pair: prompt, chosen, rejected."""
        return [*self.prompt, *self.chosen, *self.rejected]


def normalize_row(row: Any) -> Pair:
    """Validate a parsed row and return its pair; raise `RowReject` with the first problem found."""
    if not isinstance(row, dict):
        raise RowReject("not_an_object", f"a row must be a JSON object, got {_kind(row)}")
    for field in ("chosen", "rejected"):
        if field not in row or row[field] is None:
            raise RowReject("missing_field", f"field '{field}' is missing; every row needs 'chosen' and 'rejected'")
    source, row_id, tools, images = _source(row), _row_id(row), _tools(row), _images(row)
    if row.get("prompt") is None:
        if isinstance(row["chosen"], str) and isinstance(row["rejected"], str):
            _no_tools(tools)
            _no_images(images)
            prompt, chosen, rejected = _implicit_text(row["chosen"], row["rejected"])
            return Pair("text", prompt, chosen, rejected, source, row_id, form="implicit-text")
        prompt, chosen, rejected = _implicit(row["chosen"], row["rejected"])
        return Pair("chat", prompt, chosen, rejected, source, row_id, tools, "implicit-chat", images)
    prompt, chosen, rejected = row["prompt"], row["chosen"], row["rejected"]
    kinds = {f: _part_kind(f, v) for f, v in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected))}
    if _whole_conversations(prompt, chosen, rejected):
        prompt, chosen, rejected = _strip_prompt(prompt, chosen, rejected)
        return Pair("chat", prompt, chosen, rejected, source, row_id, tools, "whole-conversations", images)
    if len(set(kinds.values())) > 1:
        found = ", ".join(f"{f} is {k}" for f, k in kinds.items())
        raise RowReject(
            "mixed_formats",
            f"prompt, chosen and rejected must all be text or all be message lists; here {found}",
        )
    if kinds["prompt"] == "text":
        _check_text(prompt, chosen, rejected)
        _no_tools(tools)
        _no_images(images)
        return Pair("text", prompt, chosen, rejected, source, row_id)
    prompt, chosen, rejected = (
        _messages(f, v) for f, v in (("prompt", prompt), ("chosen", chosen), ("rejected", rejected))
    )
    _check_chat(prompt, chosen, rejected)
    return Pair("chat", prompt, chosen, rejected, source, row_id, tools, "explicit-chat", images)


def _images(row: dict) -> tuple:
    """The row's images as given: `images` (a list, TRL's field), or `image` (one image, which TRL reads as a list
    of one); an empty list or null is none."""
    images, single = row.get("images"), row.get("image")
    if images is None and single is not None:
        return (single,)
    if images is None:
        return ()
    if single is not None:
        raise RowReject(
            "wrong_type", "the row has both 'images' and 'image'; give its images once, as the list 'images'"
        )
    if not isinstance(images, list) or _is_map(images):
        raise RowReject(
            "wrong_type",
            f"field 'images' must be a list of images (file paths relative to the input file, {{\"bytes\", "
            f'"path"}} objects or binary values), got {_kind(images)}',
        )
    return tuple(images)


def _no_images(images: tuple) -> None:
    if images:
        raise RowReject(
            "wrong_type",
            f"field 'images' holds {len(images)} images, but the prompt is plain text; images are placed by "
            '{"type": "image"} parts of conversational messages: write the prompt as a list of messages',
        )


def _has_parts(message: dict) -> bool:
    """Whether a message's content is a list of parts (vision rows) rather than a string."""
    return isinstance(message.get("content"), list)


def content_text(message: dict) -> str:
    """A message's text: its content string, or its text parts joined."""
    content = message.get("content")
    if isinstance(content, list):
        return "".join(part.get("text", "") for part in content)
    return content or ""


def _no_tools(tools: list | None) -> None:
    if tools:
        raise RowReject(
            "tools_not_rendered",
            f"field 'tools' lists {len(tools)} tools, but only conversations are rendered by a chat template, so "
            f"a plain-text row would train without them; use message lists or drop 'tools'",
        )


def _kind(value: Any) -> str:
    if _is_map(value):
        key, item = value[0]
        return f"a map of {type(key).__name__} to {type(item).__name__} (a Parquet or Arrow map column)"
    return {dict: "an object", list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), "a number" if isinstance(value, (int, float)) else type(value).__name__
    )


def _is_map(value: Any) -> bool:
    """pyarrow reads a map column as a list of (key, value) tuples, which JSON never makes."""
    return isinstance(value, list) and bool(value) and all(isinstance(item, tuple) for item in value)


def _part_kind(field: str, value: Any) -> str:
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and not _is_map(value):
        return "messages"
    raise RowReject("wrong_type", f"field '{field}' must be a string or a list of messages, got {_kind(value)}")


def _source(row: dict) -> str | None:
    source = row.get("source")
    if source is None:
        return None
    if not isinstance(source, str) or not source.strip():
        raise RowReject("wrong_type", f"field 'source' must be a non-empty string, got {source!r:.80}")
    return source


def _row_id(row: dict) -> str | None:
    row_id = row.get("id")
    if row_id is None:
        return None
    if isinstance(row_id, bool) or not isinstance(row_id, (str, int)):
        raise RowReject("wrong_type", f"field 'id' must be a string or an integer, got {_kind(row_id)}")
    return str(row_id)


def _tools(row: dict) -> list[dict] | None:
    """The row's `tools`, as TRL reads it: a list of objects (tool schemas), or a JSON string of one."""
    tools = row.get("tools")
    if tools is None:
        return None
    if isinstance(tools, str):
        try:
            tools = orjson.loads(tools)
        except orjson.JSONDecodeError as e:
            raise RowReject(
                "wrong_type", f"field 'tools' is a string but not JSON ({e}); it must be a list of tool objects"
            ) from None
    if not isinstance(tools, list):
        got = _kind(tools)
    elif not all(isinstance(t, dict) for t in tools):
        got = "an array holding " + _kind(next(t for t in tools if not isinstance(t, dict)))
    else:
        return tools
    raise RowReject(
        "wrong_type",
        f'field \'tools\' must be a list of tool objects (JSON schemas, e.g. {{"type": "function", '
        f'"function": {{"name": ...}}}}) or a JSON string of one, got {got}',
    )


def _check_text(prompt: str, chosen: str, rejected: str) -> None:
    if not prompt.strip():
        raise RowReject("empty_prompt", "field 'prompt' is empty; a pair needs a prompt to condition on")
    for field, value in (("chosen", chosen), ("rejected", rejected)):
        if not value.strip():
            raise RowReject("empty_completion", f"field '{field}' is empty or whitespace only")
    if chosen == rejected:
        raise RowReject("identical_completions", "chosen and rejected are identical; the pair carries no preference")


def _messages(field: str, messages: list) -> list[dict]:
    """Validate a message list and return it without None-valued keys, the form transformers renders (it drops
    them: OpenAI exports and Parquet structs write `content: null`, `tool_calls: null`)."""
    cleaned = []
    for i, m in enumerate(messages):
        if isinstance(m, dict) and len(m) == 2 and isinstance(m.get("content"), str) and m.get("role") in ROLES:
            cleaned.append(m)  # the common plain message: nothing to check further or drop
        else:
            cleaned.append(_message(f"{field}[{i}]", m))
    return cleaned


def _message(where: str, m: Any) -> dict:
    if not isinstance(m, dict):
        raise RowReject("wrong_type", f"{where} must be an object with 'role' and 'content', got {_kind(m)}")
    if not isinstance(m.get("role"), str):
        got = "missing" if "role" not in m else _kind(m["role"])
        raise RowReject("wrong_type", f"{where}.role must be a string, got {got}")
    if m["role"] not in ROLES:
        raise RowReject("unknown_role", f"{where}.role is {m['role']!r:.40}; allowed roles are {', '.join(ROLES)}")
    calls = _tool_calls(where, m)
    if isinstance(m.get("content"), list) and not _is_map(m["content"]):
        return {**{k: v for k, v in m.items() if v is not None}, "content": _parts(where, m)}
    if not isinstance(m.get("content"), str) and not (calls and m.get("content") is None):
        got = "missing" if "content" not in m else _kind(m["content"])
        raise RowReject(
            "wrong_type",
            f"{where}.content must be a string (it may be null or absent only on an assistant message with "
            f"tool_calls), got {got}; a vision row's content may also be a list of parts ({_PART_SHAPES})",
        )
    return {k: v for k, v in m.items() if v is not None}


_PART_SHAPES = '{"type": "text", "text": a string} or {"type": "image"} (the image itself goes in the row\'s images)'


def _parts(where: str, m: dict) -> list[dict]:
    """Content parts (TRL's vision shape), each without None-valued keys (Arrow structs write them): text parts
    and image placeholders, which only user, system and assistant history messages may hold."""
    parts = []
    for j, part in enumerate(m["content"]):
        part = {k: v for k, v in part.items() if v is not None} if isinstance(part, dict) else part
        text_part = isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str)
        if not (text_part and len(part) == 2) and part != {"type": "image"}:
            raise RowReject("wrong_type", f"{where}.content[{j}] is {part!r:.120}; a content part is {_PART_SHAPES}")
        if part["type"] == "image" and m["role"] == "tool":
            raise RowReject(
                "wrong_type", f"{where}.content[{j}] is an image part in a tool message; images go in user messages"
            )
        parts.append(part)
    return parts


def _tool_calls(where: str, message: dict) -> list:
    """A message's tool calls (OpenAI / transformers shape), [] when it has none."""
    calls = message.get("tool_calls")
    if calls is None:
        return []
    if message["role"] != "assistant":
        raise RowReject("wrong_type", f"{where} has tool_calls, but only assistant messages can call tools")
    if not isinstance(calls, list):
        raise RowReject("wrong_type", f"{where}.tool_calls must be a list of tool calls, got {_kind(calls)}")
    for j, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if (
            not isinstance(function, dict)
            or call.get("type") != "function"
            or not isinstance(function.get("name"), str)
            or not function["name"]
            or not isinstance(function.get("arguments"), (dict, str))
        ):
            raise RowReject(
                "wrong_type",
                f"{where}.tool_calls[{j}] is {call!r:.120}; a tool call must be "
                f'{{"type": "function", "function": {{"name": a non-empty string, "arguments": an object or a '
                f"JSON string}}}}",
            )
    return calls


def _has_content(message: dict) -> bool:
    return bool(content_text(message).strip() or message.get("tool_calls"))


def _check_text_completion(field: str, completion: list) -> None:
    """Completions are text: an image part there would be a generated image."""
    for i, m in enumerate(completion):
        if _has_parts(m) and any(part["type"] == "image" for part in m["content"]):
            raise RowReject(
                "wrong_type",
                f"{field}[{i}] holds an image part; completions are text, images belong to the prompt: move the "
                "image part into a prompt message",
            )


def _check_chat(prompt: list, chosen: list, rejected: list) -> None:
    """Checks on validated (`_messages`) lists."""
    if not prompt:
        raise RowReject("empty_prompt", "field 'prompt' is an empty message list")
    for field, value in (("chosen", chosen), ("rejected", rejected)):
        _check_text_completion(field, value)
        if not value or not any(map(_has_content, value)):
            raise RowReject("empty_completion", f"field '{field}' has no message with content or a tool call")
    if chosen == rejected:
        raise RowReject("identical_completions", "chosen and rejected are identical; the pair carries no preference")
    for field, value in (("chosen", chosen), ("rejected", rejected)):
        _check_order(field, prompt, value)


def _check_order(field: str, prompt: list, completion: list) -> None:
    """System first only; no two user or two assistant turns in a row; the prompt ends on a user or tool
    turn; the completion starts and ends with an assistant turn."""
    roles = [m["role"] for m in prompt + completion]
    where = f"prompt + {field} roles {roles}"
    if "system" in roles[1:]:
        raise RowReject("roles_out_of_order", f"{where}: a system message may only come first")
    body = roles[1:] if roles[0] == "system" else roles
    if not body or body[0] != "user":
        raise RowReject("roles_out_of_order", f"{where}: the first non-system message must be from the user")
    for a, b in zip(body, body[1:]):
        if a == b and a in ("user", "assistant"):
            raise RowReject("roles_out_of_order", f"{where}: two '{a}' messages in a row")
    if prompt[-1]["role"] not in ("user", "tool"):
        raise RowReject("roles_out_of_order", f"{where}: the prompt must end with a user or tool message")
    if completion[0]["role"] != "assistant" or completion[-1]["role"] != "assistant":
        raise RowReject(
            "roles_out_of_order", f"{where}: the {field} completion must start and end with an assistant message"
        )


def _implicit(chosen: Any, rejected: Any) -> tuple[list, list, list]:
    """Split two full conversations into (shared prompt, chosen turn, rejected turn)."""
    for field, value in (("chosen", chosen), ("rejected", rejected)):
        if isinstance(value, str):
            raise RowReject(
                "mixed_formats",
                f"without 'prompt', chosen and rejected must both be full conversations (lists of messages) or both "
                f"full texts; here {field} is text and the other is {_kind(rejected if field == 'chosen' else chosen)}",
            )
        if not isinstance(value, list) or _is_map(value):
            raise RowReject(
                "wrong_type",
                f"without 'prompt', field '{field}' must be a full conversation (a list of messages) or a full text "
                f"(a string), got {_kind(value)}",
            )
    chosen, rejected = _messages("chosen", chosen), _messages("rejected", rejected)
    shared = 0
    while shared < min(len(chosen), len(rejected)) and chosen[shared] == rejected[shared]:
        shared += 1
    if shared == len(chosen) == len(rejected):
        raise RowReject("identical_completions", "chosen and rejected are identical conversations")
    if shared == 0:
        raise RowReject("history_diverges", "chosen and rejected share no first message, so there is no prompt")
    if shared != len(chosen) - 1 or shared != len(rejected) - 1:
        raise RowReject(
            "history_diverges",
            f"chosen ({len(chosen)} messages) and rejected ({len(rejected)} messages) differ from message "
            f"{shared} on; they may differ only in their final assistant turn",
        )
    prompt = chosen[:shared]
    _check_chat(prompt, chosen[shared:], rejected[shared:])
    return prompt, chosen[shared:], rejected[shared:]


def _implicit_text(chosen: str, rejected: str) -> tuple[str, str, str]:
    """Split two full plain-text conversations (HH-RLHF's `\\n\\nHuman: ...\\n\\nAssistant: ...`) into (prompt,
    chosen answer, rejected answer). The prompt is their shared text through its last `\\n\\nAssistant:`, which must
    open the final turn of both: where the answers differ from their first word, this is TRL 1.16's `extract_prompt`
    (the longest common prefix, less a trailing space). Where the answers open alike, TRL's prefix runs into them (a
    word split across prompt and completion); here it stops at the turn, and the shared opening is scored in both."""
    if chosen == rejected:
        raise RowReject(
            "identical_completions", "chosen and rejected are identical texts; the pair carries no preference"
        )
    shared = next((i for i, (x, y) in enumerate(zip(chosen, rejected)) if x != y), min(len(chosen), len(rejected)))
    turn = chosen.rfind(ASSISTANT_TURN, 0, shared)
    if turn < 0:
        raise RowReject(
            "no_implicit_prompt",
            f"without 'prompt', plain-text chosen and rejected are split where their shared text ends at an assistant "
            f"turn ({ASSISTANT_TURN!r}), but the {shared} characters they share ({chosen[:shared]!r:.80}) hold none; "
            "fix: give the prompt as a 'prompt' field (or map one with --columns), or write each turn as "
            f"'{HUMAN_TURN[2:]} ...' / '{ASSISTANT_TURN[2:]} ...' after a blank line as HH-RLHF does",
        )
    end = turn + len(ASSISTANT_TURN)
    for field, answer in (("chosen", chosen[end:]), ("rejected", rejected[end:])):
        _check_final_answer(field, answer, turn)
    return chosen[:end], chosen[end:], rejected[end:]


def _check_final_answer(field: str, answer: str, turn: int) -> None:
    """What follows the implicit prompt is one answer: no later turn (the texts would differ before their final
    assistant turn, `history_diverges` as for conversations), and not empty."""
    later = min((i for i in (answer.find(HUMAN_TURN), answer.find(ASSISTANT_TURN)) if i >= 0), default=-1)
    if later >= 0:
        raise RowReject(
            "history_diverges",
            f"without 'prompt', plain-text chosen and rejected share their text only up to the assistant turn at "
            f"character {turn}, and {field} goes on past that turn ({answer[later:]!r:.60}): they may differ only in "
            "their final assistant turn; fix: give the shared history as 'prompt'",
        )
    if not answer.strip():
        raise RowReject(
            "empty_completion",
            f"field '{field}' is empty or whitespace only after its implicit prompt (the text through the final "
            f"{ASSISTANT_TURN!r})",
        )


def _prompt_turns(prompt: str | list, conversation: list) -> list:
    """The turns a prompt stands for: a string is one user turn with that content (UltraFeedback's `prompt`), after
    the conversation's opening system message when it has one (TRL 1.16's `maybe_extract_prompt` drops such a string
    and takes the shared prefix, system message and user turn, as the prompt)."""
    if not isinstance(prompt, str):
        return prompt
    system = conversation[:1] if conversation and conversation[0]["role"] == "system" else []
    return [*system, {"role": "user", "content": prompt}]


def _opening_roles(prompt: Any) -> tuple:
    """The roles a whole conversation beside `prompt` may open with: the prompt's first role, or, for a string
    prompt (a user turn), a system message in front of it."""
    if isinstance(prompt, str):
        return ("user", "system")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict) and prompt[0].get("role") != "assistant":
        return (prompt[0].get("role"),)
    return ()


def _whole_conversations(prompt: Any, chosen: Any, rejected: Any) -> bool:
    """Whether chosen and rejected are whole conversations beside an explicit prompt (the UltraFeedback-binarized
    shape): both open with a message of a role the prompt opens with, where a completion opens with an assistant
    turn. Any other row keeps the explicit-prompt rules (and their rejects)."""
    roles = _opening_roles(prompt)
    return bool(roles) and all(
        isinstance(v, list) and v and isinstance(v[0], dict) and v[0].get("role") in roles for v in (chosen, rejected)
    )


def _strip_prompt(prompt: str | list, chosen: list, rejected: list) -> tuple[list, list, list]:
    """Split whole conversations at the prompt's turns, which both must begin with, into (prompt, chosen turns,
    rejected turns). TRL 1.16's `maybe_extract_prompt` drops a string prompt and keeps whatever prefix the
    conversations share; here the prefix must be the prompt, so a prompt column that disagrees is named."""
    if isinstance(prompt, str) and not prompt.strip():
        raise RowReject("empty_prompt", "field 'prompt' is empty; a pair needs a prompt to condition on")
    chosen, rejected = _messages("chosen", chosen), _messages("rejected", rejected)
    turns = _messages("prompt", _prompt_turns(prompt, chosen))
    for field, conversation in (("chosen", chosen), ("rejected", rejected)):
        _check_prefix(field, turns, conversation, isinstance(prompt, str))
    _check_chat(turns, chosen[len(turns) :], rejected[len(turns) :])
    return turns, chosen[len(turns) :], rejected[len(turns) :]


def _check_prefix(field: str, turns: list, conversation: list, from_text: bool) -> None:
    """`conversation` begins with exactly the prompt's `turns`, else a `prompt_not_prefix` reject naming the first
    message that differs."""
    for i, turn in enumerate(turns):
        if i >= len(conversation) or conversation[i] != turn:
            got = f"{conversation[i]!r:.120}" if i < len(conversation) else "nothing (the conversation is shorter)"
            spelled = "the 'prompt' messages"
            if from_text:
                system = "chosen's system message, then " if turns[0]["role"] == "system" else ""
                spelled = f"{system}the string 'prompt' as one user turn"
            raise RowReject(
                "prompt_not_prefix",
                f"field '{field}' is a whole conversation but does not begin with {spelled}: {field}[{i}] is {got}, "
                f"the prompt's turn {i} is {turn!r:.120}; fix: make the prompt the conversations' leading turns, "
                "or drop 'prompt' (--columns prompt= reads none) so their shared prefix is the prompt",
            )
