"""Tool calls and a row's `tools`: rendered through the chat template exactly as TRL 1.16 renders them, or the row is
rejected by name where the template would drop them; malformed shapes are named rejects.

SmolLM2's template ignores both, so its rows with tool data are rejected. Token-id parity with TRL needs a template
that renders them: `TOOL_TEMPLATE` (Qwen2.5's tool-calling ChatML template, which uses SmolLM2's own <|im_start|> /
<|im_end|> tokens) is set on a copy of the SmolLM2 tokenizer, our build writes shards with it, and a real
`DPOTrainer` prepares the same rows (see tests/trl/test_trl_parity.py for why a real trainer).
"""

from __future__ import annotations

import copy
import json

import pyarrow as pa
import pytest

from dpo_data.dataset.manifest import read_manifest
from dpo_data.dataset.shards import open_shard
from dpo_data.prepare.build import BuildOptions, build
from dpo_data.prepare.rows import RowReject, normalize_row
from dpo_data.prepare.tokenize import EncodedPair, PairEncoder, TokenizeOptions
from dpo_state.schema import load_schema, schema_problems
from tests.conftest import write_jsonl
from tests.trl.test_trl_parity import assistant, describe, system, tool, trl_prepare, user

TOOL_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] }}"
    "{%- else %}{{- 'You are a helpful assistant.' }}{%- endif %}"
    "{{- '\\n\\n# Tools\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}"
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}"
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object within <tool_call></tool_call> XML tags."
    "<|im_end|>\\n' }}"
    "{%- else %}{%- if messages[0]['role'] == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}"
    "{%- else %}{{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{%- endif %}{%- endif %}"
    "{%- for message in messages %}"
    "{%- if (message.role == 'user') or (message.role == 'system' and not loop.first)"
    " or (message.role == 'assistant' and not message.tool_calls) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{{- '<|im_start|>' + message.role }}"
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}"
    "{%- for tool_call in message.tool_calls %}"
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' }}{{- tool_call.name }}{{- \'", "arguments": \' }}'
    "{%- if tool_call.arguments is string %}{{- tool_call.arguments }}"
    "{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}"
    "{{- '}\\n</tool_call>' }}{%- endfor %}{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "description": "The city's name"}},
            "required": ["city"],
        },
    },
}
MULTIPLY = {
    "type": "function",
    "function": {
        "name": "multiply",
        "description": "Multiply two integers.",
        "parameters": {
            "type": "object",
            "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
            "required": ["a", "b"],
        },
    },
}


def call(name: str, arguments) -> dict:
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


def calling(*calls: dict, content: str | None = None) -> dict:
    """An assistant message with tool calls; content None as OpenAI exports write it (transformers drops it)."""
    return {"role": "assistant", "content": content, "tool_calls": list(calls)}


# Each row is its own TRL dataset: Arrow unifies the message structs of a column, and across rows it would fill
# other rows' keys with nulls inside nested values (tool arguments), which TRL then renders.
TOOL_ROWS = {
    "calls_in_prompt": {
        "prompt": [
            user("What's the weather in Oslo?"),
            calling(call("get_weather", {"city": "Oslo"}), content=""),
            tool('{"temp_c": -3}'),
        ],
        "chosen": [assistant("It is -3 °C in Oslo.")],
        "rejected": [assistant("It is sunny and 30 °C.")],
    },
    "tools_list_call_completion": {
        "tools": [MULTIPLY],
        "prompt": [user("What is 17 * 23?")],
        "chosen": [calling(call("multiply", {"a": 17, "b": 23}))],
        "rejected": [assistant("17 * 23 = 381.")],
    },
    "tools_json_string_two_calls": {
        "tools": json.dumps([WEATHER, MULTIPLY]),
        "prompt": [
            system("Be brief."),
            user("Weather in Oslo and Bergen?"),
            calling(
                call("get_weather", '{"city": "Oslo"}'),
                call("get_weather", '{"city": "Bergen"}'),
                content="Checking both.",
            ),
            tool("-3 °C"),
            tool("4 °C"),
        ],
        "chosen": [assistant("Oslo -3 °C, Bergen 4 °C.")],
        "rejected": [assistant("Both are warm.")],
    },
    "multi_step_completion": {
        "tools": [MULTIPLY],
        "prompt": [user("Compute 17 * 23 with the tool.")],
        "chosen": [calling(call("multiply", {"a": 17, "b": 23})), tool("391"), assistant("17 * 23 = 391.")],
        "rejected": [assistant("391, I think.")],
    },
    "implicit_prompt": {
        "tools": [WEATHER],
        "chosen": [user("Weather in Oslo?"), calling(call("get_weather", {"city": "Oslo"}))],
        "rejected": [user("Weather in Oslo?"), calling(call("get_weather", {"city": "Bergen"}))],
    },
}


# -- fixtures --------------------------------------------------------------------------------------


def with_template(smollm2_dir, out_dir, template: str):
    """A saved copy of the SmolLM2 tokenizer with `template` as its chat template."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    tokenizer.chat_template = template
    tokenizer.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="module")
def tool_dir(smollm2_dir, tmp_path_factory):
    return with_template(smollm2_dir, tmp_path_factory.mktemp("tool-tokenizer"), TOOL_TEMPLATE)


@pytest.fixture(scope="module")
def tool_tokenizer(tool_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tool_dir)


@pytest.fixture(scope="module")
def built(tool_dir, tmp_path_factory):
    """Our build of TOOL_ROWS with the tool template: ({row name: shard row}, manifest, {row name: reject})."""
    tmp = tmp_path_factory.mktemp("tool-build")
    rows = [{**row, "id": name} for name, row in TOOL_ROWS.items()]
    build([str(write_jsonl(tmp / "tools.jsonl", rows))], str(tool_dir), tmp / "ds", BuildOptions())
    manifest = read_manifest(tmp / "ds")
    shard_rows = [r for s in manifest["shards"] for r in open_shard(tmp / "ds" / s["path"]).to_pylist()]
    records = [json.loads(line) for line in (tmp / "ds" / "rejects.jsonl").read_text().splitlines()]
    rejects = {json.loads(r["raw"])["id"]: f"{r['reason']}: {r['message']}" for r in records}
    return {r["row_id"]: r for r in shard_rows}, manifest, rejects


@pytest.fixture(scope="module")
def trl_prepared(tool_dir, tmp_path_factory):
    """TRL's prepared rows, one dataset per row (Arrow would fill other rows' keys with nulls inside nested
    tool arguments, which TRL then renders): {row name: {'prompt_ids', 'chosen_ids', 'rejected_ids', ...}}."""
    sets = {name: [row] for name, row in TOOL_ROWS.items()}
    prepared = trl_prepare(tool_dir, sets, tmp_path_factory.mktemp("trl"))
    return {name: rows[0] for name, rows in prepared.items()}


def encode(tokenizer, row) -> EncodedPair | RowReject:
    try:
        pair = normalize_row(row)
    except RowReject as reject:
        return reject
    (result,) = PairEncoder(tokenizer, TokenizeOptions()).encode_many([pair])
    return result


def rejected_as(tokenizer, row, reason: str) -> str:
    result = encode(tokenizer, row)
    assert isinstance(result, RowReject), f"kept: {tokenizer.decode(result.prompt)!r}"
    assert result.reason == reason, result.message
    return result.message


# -- parity with TRL -------------------------------------------------------------------------------


@pytest.mark.parametrize("name", list(TOOL_ROWS))
def test_ids_equal_trl_with_a_tool_calling_template(name, built, trl_prepared, tool_tokenizer):
    assert name not in built[2], f"we reject a row TRL renders: {built[2][name]}"
    mine, theirs = built[0][name], trl_prepared[name]
    report = []
    for part in ("prompt", "chosen", "rejected"):
        a, b = mine[f"{part}_ids"], theirs[f"{part}_ids"]
        if a != b:
            report.append(
                f"{part} differs\n{describe(tool_tokenizer, 'ours', a)}\n{describe(tool_tokenizer, 'trl ', b)}"
            )
    assert not report, f"row {name}\n" + "\n".join(report)


def test_tool_data_reaches_the_ids(built, tool_tokenizer):
    """The parity rows really carry their tool data (a parity of two renderings that both drop it proves nothing)."""
    rows = built[0]

    def text(name, part):
        return tool_tokenizer.decode(rows[name][f"{part}_ids"])

    assert '{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text("calls_in_prompt", "prompt")
    assert "<tools>" not in text("calls_in_prompt", "prompt")  # no tools field: no tools block
    assert json.dumps(MULTIPLY) in text("tools_list_call_completion", "prompt")
    assert text("tools_list_call_completion", "chosen") == (
        '<tool_call>\n{"name": "multiply", "arguments": {"a": 17, "b": 23}}\n</tool_call><|im_end|>\n'
    )
    prompt = text("tools_json_string_two_calls", "prompt")
    assert json.dumps(WEATHER) in prompt and json.dumps(MULTIPLY) in prompt  # the JSON string is parsed, as TRL does
    assert prompt.count('<tool_call>\n{"name": "get_weather"') == 2 and prompt.count("<tool_response>") == 2
    assert text("implicit_prompt", "rejected").startswith(
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bergen"}'
    )


def test_the_manifest_attests_the_tool_template(built, smollm2_dir, tool_tokenizer, tokenizer):
    """A changed chat template is part of the tokenizer attestation, so its datasets never pass for SmolLM2's."""
    from dpo_state.attestation import attestation_mismatch, tokenizer_attestation

    recorded = built[1]["tokenizer"]
    assert recorded == tokenizer_attestation(tool_tokenizer)
    mismatch = attestation_mismatch(recorded, tokenizer_attestation(tokenizer), "SmolLM2", "the dataset")
    assert mismatch is not None and "chat_template" in mismatch


# -- templates that cannot render them -------------------------------------------------------------


def test_smollm2_rows_with_tool_calls_or_tools_are_rejected_by_name(tokenizer):
    """SmolLM2's template never reads tool_calls or tools: a tool call in the prompt or completion, or a tools
    list, would vanish from the ids (the prompt would hold an empty assistant turn)."""
    message = rejected_as(tokenizer, TOOL_ROWS["calls_in_prompt"], "tool_calls_not_rendered")
    assert message.startswith("prompt[1] has tool_calls, but the chat template never reads 'tool_calls'")
    # a content-less call: without the up-front check the template's own failure (no 'content') would hide why
    assert rejected_as(tokenizer, TOOL_ROWS["tools_list_call_completion"], "tool_calls_not_rendered").startswith(
        "chosen[0] has tool_calls"
    )
    row = {**TOOL_ROWS["tools_list_call_completion"], "chosen": [assistant("I'll multiply: 391.")]}
    assert rejected_as(tokenizer, row, "tools_not_rendered").startswith(
        "the chat template renders the prompt the same with and without the row's 1 tools"
    )
    text_row = {"prompt": "Q: 17 * 23?\nA:", "chosen": " 391", "rejected": " 381", "tools": [MULTIPLY]}
    assert "only conversations are rendered by a chat template" in rejected_as(
        tokenizer, text_row, "tools_not_rendered"
    )


def test_a_template_that_drops_calls_in_some_positions_is_caught_by_rendering_both_ways(tokenizer):
    """The source check passes (the template names tool_calls), but the history's call renders as nothing."""
    clone = copy.deepcopy(tokenizer)
    clone.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
        "{% if m.tool_calls and loop.last %}{{ m.tool_calls | tojson }}{% endif %}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    message = rejected_as(clone, TOOL_ROWS["calls_in_prompt"], "tool_calls_not_rendered")
    assert message.startswith("the chat template renders prompt[1] the same with and without its tool_calls")
    # the last message's call is rendered, so a call completion is kept, with the call in its ids
    row = {
        "prompt": [user("17 * 23?")],
        "chosen": [calling(call("multiply", {"a": 17}), content="")],
        "rejected": [assistant("381")],
    }
    pair = encode(clone, row)
    assert isinstance(pair, EncodedPair) and '"multiply"' in clone.decode(pair.chosen)


def test_tools_placed_before_the_last_message_are_not_prefix_stable(tool_tokenizer):
    """The prefix check sees the tool rendering too: a template that writes the tools before the final message
    renders them before the user turn in the prompt and before the answer in prompt + completion."""
    clone = copy.deepcopy(tool_tokenizer)
    clone.chat_template = (
        "{% for m in messages %}{% if loop.last and tools %}[TOOLS]{{ tools | tojson }}[/TOOLS]{% endif %}"
        "<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    row = {
        "tools": [MULTIPLY],
        "prompt": [user("17 * 23?")],
        "chosen": [assistant("391")],
        "rejected": [assistant("381")],
    }
    assert "renders the prompt differently alone" in rejected_as(clone, row, "template_not_prefix_stable")


# -- shapes ----------------------------------------------------------------------------------------

PROMPT = [user("17 * 23?")]
REJECTED = [assistant("381")]
MALFORMED = {
    "calls not a list": (
        [{"role": "assistant", "content": "", "tool_calls": {"name": "f"}}],
        "chosen[0].tool_calls must be a list of tool calls, got an object",
    ),
    "call not an object": (
        [{"role": "assistant", "content": "", "tool_calls": ["multiply(17, 23)"]}],
        "chosen[0].tool_calls[0] is 'multiply(17, 23)'; a tool call must be",
    ),
    "flat call": ([calling({"name": "multiply", "arguments": {}})], "chosen[0].tool_calls[0] is {'name': 'multiply'"),
    "type not function": (
        [calling({"type": "code", "function": {"name": "f", "arguments": {}}})],
        "chosen[0].tool_calls[0] is {'type': 'code'",
    ),
    "no name": (
        [calling({"type": "function", "function": {"arguments": {}}})],
        "chosen[0].tool_calls[0] is {'type': 'function', 'function': {'arguments': {}}}; a tool call must be",
    ),
    "empty name": ([calling(call("", {}))], "'name': ''"),
    "arguments a number": ([calling(call("f", 3))], '"arguments": an object or a JSON string'),
    "content null without calls": (
        [{"role": "assistant", "content": None}],
        "chosen[0].content must be a string (it may be null or absent only on an "
        "assistant message with tool_calls), got null",
    ),
    "content absent with empty calls": (
        [{"role": "assistant", "tool_calls": []}],
        "chosen[0].content must be a string",
    ),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_tool_calls_are_named_rejects(case):
    chosen, expected = MALFORMED[case]
    with pytest.raises(RowReject) as info:
        normalize_row({"prompt": PROMPT, "chosen": chosen, "rejected": REJECTED})
    assert info.value.reason == "wrong_type"
    assert expected in info.value.message


def test_tool_calls_only_on_assistant_messages():
    prompt = [{"role": "user", "content": "q", "tool_calls": [call("f", {})]}]
    with pytest.raises(RowReject, match=r"prompt\[0\] has tool_calls, but only assistant messages can call tools"):
        normalize_row({"prompt": prompt, "chosen": [assistant("a")], "rejected": REJECTED})


@pytest.mark.parametrize(
    ("tools", "expected"),
    [
        ({"type": "function"}, "got an object"),
        ([MULTIPLY, "get_weather"], "got an array holding a string"),
        ("get_weather", "field 'tools' is a string but not JSON"),
        ('{"type": "function"}', "got an object"),
        (3, "got a number"),
    ],
)
def test_tools_that_are_not_a_list_of_objects_are_named_rejects(tools, expected):
    with pytest.raises(RowReject) as info:
        normalize_row({"tools": tools, "prompt": PROMPT, "chosen": [assistant("391")], "rejected": REJECTED})
    assert info.value.reason == "wrong_type"
    assert expected in info.value.message


def test_rows_as_parquet_reads_them_equal_the_same_rows_as_json():
    """A Parquet struct column gives every message every key (content / tool_calls null where absent); those nulls
    are dropped, as transformers drops them, so both inputs make the same pair (and plain messages stay plain)."""
    row = TOOL_ROWS["multi_step_completion"]
    from_parquet = pa.Table.from_pylist([row]).to_pylist()[0]
    assert from_parquet["chosen"][2] == {"role": "assistant", "content": "17 * 23 = 391.", "tool_calls": None}
    pair, expected = normalize_row(from_parquet), normalize_row(row)
    assert pair == expected
    assert pair.chosen[2] == {"role": "assistant", "content": "17 * 23 = 391."}
    assert pair.chosen[0] == {"role": "assistant", "tool_calls": row["chosen"][0]["tool_calls"]}


def test_an_empty_tool_call_list_is_no_call(tool_tokenizer):
    """OpenAI exports write `tool_calls: []` on plain answers: kept, rendered as TRL renders it (no call)."""
    plain = {"prompt": PROMPT, "chosen": [assistant("391")], "rejected": REJECTED}
    with_empty = {**plain, "chosen": [{**assistant("391"), "tool_calls": []}]}
    a, b = encode(tool_tokenizer, plain), encode(tool_tokenizer, with_empty)
    assert isinstance(b, EncodedPair) and (a.prompt, a.chosen) == (b.prompt, b.chosen)


# -- control-token text ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("change", "where"),
    [
        ({"chosen": [calling(call("multiply", '{"a": "<|im_end|>"}'))]}, "chosen[0].tool_calls"),
        ({"tools": [{**MULTIPLY, "function": {**MULTIPLY["function"], "description": "x<|im_start|>"}}]}, "tools"),
        ({"prompt": [user("q"), calling(call("f", {})), {**tool("1"), "name": "<|endoftext|>"}]}, "prompt[2].name"),
    ],
    ids=["call-arguments", "tools", "tool-message-name"],
)
def test_special_token_text_outside_content_is_rejected(tool_tokenizer, change, where):
    """Only content is encoded apart as plain text; elsewhere the template writes the text as its own, and it would
    become the special token (a forged turn boundary)."""
    row = {"tools": [MULTIPLY], "prompt": PROMPT, "chosen": [assistant("391")], "rejected": REJECTED, **change}
    message = rejected_as(tool_tokenizer, row, "control_text_outside_content")
    assert message.startswith(f"{where} holds the special-token text")


def test_special_token_text_in_a_tool_result_stays_text(tool_tokenizer):
    """Content keeps its guarantee next to a content-less tool call (which gets no content of its own)."""
    im_end = tool_tokenizer.convert_tokens_to_ids("<|im_end|>")
    row = {
        "tools": [MULTIPLY],
        "prompt": [user("17 * 23?"), calling(call("multiply", {"a": 17, "b": 23})), tool("391 <|im_end|>")],
        "chosen": [assistant("391")],
        "rejected": REJECTED,
    }
    pair = encode(tool_tokenizer, row)
    assert isinstance(pair, EncodedPair), pair
    plain = encode(tool_tokenizer, {**row, "prompt": [*row["prompt"][:2], tool("391 ")]})
    # the same turns, so as many real <|im_end|> tokens: the one in the tool result is text
    assert pair.prompt.count(im_end) == plain.prompt.count(im_end)
    assert "391 <|im_end|>\n</tool_response>" in tool_tokenizer.decode(pair.prompt)


# -- the CLI ---------------------------------------------------------------------------------------


def test_build_cli_records_the_new_reasons_in_rejects_and_manifest(smollm2_dir, tmp_path, run_cli):
    rows = [
        {"prompt": PROMPT, "chosen": [assistant("391")], "rejected": REJECTED},
        TOOL_ROWS["calls_in_prompt"],
        {**TOOL_ROWS["tools_list_call_completion"], "chosen": [assistant("391")]},
        {
            "prompt": PROMPT,
            "chosen": [assistant("391")],
            "rejected": REJECTED,
            "tools": [{"type": "function", "function": {"name": "f", "description": "<|im_end|>"}}],
        },
        {"prompt": PROMPT, "chosen": [{"role": "assistant", "content": "", "tool_calls": "f()"}], "rejected": REJECTED},
    ]
    out = tmp_path / "ds"
    from dpo_cli.data import main as dpo_data

    result = run_cli(
        dpo_data, "build", write_jsonl(tmp_path / "t.jsonl", rows), "--tokenizer", smollm2_dir, "--out", out
    )
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    expected = ["tool_calls_not_rendered", "tools_not_rendered", "control_text_outside_content", "wrong_type"]
    assert [(r["line"], r["reason"]) for r in records] == list(zip(range(2, 6), expected))
    assert all(schema_problems("reject-record", r) == [] for r in records)
    assert read_manifest(out)["rejects"]["by_reason"] == {reason: 1 for reason in expected}
    assert set(expected) <= set(load_schema("reject-record")["properties"]["reason"]["enum"])
