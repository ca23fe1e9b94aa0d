"""The light tokenizer (dpo_data/tokenizer/light.py) holds what transformers' object holds, for every tokenizer
directory the suite uses and the settings the light reader takes; anything else is left to transformers. Its
Jinja environment (dpo_data/tokenizer/chat.py) is transformers' option by option and rendering by rendering."""

from __future__ import annotations

import json
import shutil

import orjson
import pytest

from dpo_data.prepare.rows import RowReject, normalize_row
from dpo_data.prepare.template import ChatRenderer
from dpo_data.prepare.tokenize import PairEncoder, TokenizeOptions
from dpo_data.tokenizer import load_tokenizer
from dpo_data.tokenizer.chat import chat_environment
from dpo_data.tokenizer.light import LightTokenizer, read_light, refusal
from dpo_state.attestation import tokenizer_attestation
from tests.data.test_chat_template import THINKS_ON_BANG
from tests.data.test_template import CONVERSATIONS
from tests.data.test_tool_calls import TOOL_ROWS, TOOL_TEMPLATE

FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
TEXTS = [
    "",
    "hello world",
    "  leading and trailing  ",
    "<|im_start|>user\nhi<|im_end|>\n",
    "héllo\n\n日本 🙂 <|endoftext|> <|im_end|>x",
    "<an-added-token>and<|tool|> <mask>",
]
REASONING = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "4", "reasoning": "two and two", "extra": None},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "6", "thinking": "three and three"},
]
READS_EVERYTHING = (
    "{{ bos_token }}{% if tools %}{{ tools | tojson }}\n{% endif %}{% for m in messages %}"
    "{{ m.role }}:{{ m.thinking | default('-') }}/{{ m.reasoning_content | default('-') }}/{{ m.content }}"
    "{% if m.tool_calls %}{{ m.tool_calls | tojson }}{% endif %}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)
"""A template that renders reasoning under both names, tools, tool calls and special-token variables."""


def _copy(smollm2_dir, tmp_path, name: str):
    d = tmp_path / name
    d.mkdir()
    for file in FILES:
        shutil.copy(smollm2_dir / file, d / file)
    return d


def _edit_json(path, **changes):
    document = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            document.pop(key, None)
        else:
            document[key] = value
    path.write_text(json.dumps(document))


def _saved(smollm2_dir, tmp_path, name, change):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    change(tokenizer)
    tokenizer.save_pretrained(tmp_path / name)
    return tmp_path / name


def _v4_config(smollm2_dir, tmp_path):
    """A config as transformers 4 saved it: the added tokens listed (one with other flags than tokenizer.json's),
    add_bos_token (dropped by transformers 5), a legacy special_tokens_map.json (then unread), the template inline."""
    d = _copy(smollm2_dir, tmp_path, "v4")
    added = json.loads((d / "tokenizer.json").read_text())["added_tokens"]
    decoder = {str(t["id"]): {k: v for k, v in t.items() if k != "id"} for t in added}
    decoder["5"].update(lstrip=True, special=False, normalized=True)
    template = (d / "chat_template.jinja").read_text()
    (d / "chat_template.jinja").unlink()
    _edit_json(
        d / "tokenizer_config.json",
        added_tokens_decoder=decoder,
        add_bos_token=True,
        add_eos_token=True,
        chat_template=template,
        legacy=False,
        errors="replace",
        clean_up_tokenization_spaces=True,
        padding_side="left",
    )
    (d / "special_tokens_map.json").write_text(json.dumps({"bos_token": "<|endoftext|>"}))
    return d


def _specials(smollm2_dir, tmp_path):
    """Special tokens outside the vocabulary (added on load) and one already there, and split_special_tokens."""
    d = _copy(smollm2_dir, tmp_path, "specials")
    _edit_json(
        d / "tokenizer_config.json",
        mask_token="<mask>",
        sep_token="<|endoftext|>",
        additional_special_tokens=["<|tool|>", "<|im_end|>"],
        split_special_tokens=True,
    )
    return d


def _named_in_config(smollm2_dir, tmp_path):
    d = _copy(smollm2_dir, tmp_path, "named")
    default = (d / "chat_template.jinja").read_text()
    (d / "chat_template.jinja").unlink()
    templates = [{"name": "default", "template": default}, {"name": "tool_use", "template": TOOL_TEMPLATE}]
    _edit_json(d / "tokenizer_config.json", chat_template=templates)
    return d


def _template_files(smollm2_dir, tmp_path, default: bool = True):
    d = _copy(smollm2_dir, tmp_path, f"files-{default}")
    (d / "additional_chat_templates").mkdir()
    (d / "additional_chat_templates" / "tool_use.jinja").write_text(TOOL_TEMPLATE)
    if not default:  # the config's template is then replaced by the files' dict, which has no default
        _edit_json(d / "tokenizer_config.json", chat_template=(d / "chat_template.jinja").read_text())
        (d / "chat_template.jinja").unlink()
    return d


def _crlf(smollm2_dir, tmp_path):
    d = _copy(smollm2_dir, tmp_path, "crlf")
    path = d / "chat_template.jinja"
    path.write_bytes(path.read_bytes().replace(b"\n", b"\r\n"))
    return d


def _no_post_processor(smollm2_dir, tmp_path):
    d = _copy(smollm2_dir, tmp_path, "bare")
    spec = json.loads((d / "tokenizer.json").read_text())
    spec["post_processor"] = None
    (d / "tokenizer.json").write_text(json.dumps(spec))
    return d


def _own_template(smollm2_dir, tmp_path, template=THINKS_ON_BANG):
    d = _copy(smollm2_dir, tmp_path, "own")
    (d / "chat_template.jinja").write_text(template)
    return d


VARIANTS = {
    "model": lambda src, tmp: src,
    "saved alone": lambda src, tmp: _saved(src, tmp, "alone", lambda t: None),
    "tool template": lambda src, tmp: _saved(src, tmp, "tools", lambda t: setattr(t, "chat_template", TOOL_TEMPLATE)),
    "added token": lambda src, tmp: _saved(src, tmp, "plus", lambda t: t.add_tokens(["<an-added-token>"])),
    "added special tokens": lambda src, tmp: _saved(
        src, tmp, "plus-special", lambda t: t.add_special_tokens({"extra_special_tokens": ["<|tool|>"]})
    ),
    "transformers 4 config": _v4_config,
    "special tokens outside the vocabulary": _specials,
    "named templates in the config": _named_in_config,
    "template files": _template_files,
    "template files without a default": lambda src, tmp: _template_files(src, tmp, default=False),
    "CRLF template file": _crlf,
    "no post-processor": _no_post_processor,
    "thinking template": _own_template,
    "a template reading everything": lambda src, tmp: _own_template(src, tmp, READS_EVERYTHING),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, smollm2_dir, tmp_path_factory):
    """(light tokenizer, transformers' AutoTokenizer) of one directory."""
    from transformers import AutoTokenizer

    directory = VARIANTS[request.param](smollm2_dir, tmp_path_factory.mktemp("variant"))
    assert refusal(directory) is None
    light = load_tokenizer(directory)
    assert isinstance(light, LightTokenizer)
    return light, AutoTokenizer.from_pretrained(directory)


def test_the_attestation_is_byte_for_byte_transformers(pair):
    light, theirs = pair
    assert tokenizer_attestation(light) == tokenizer_attestation(theirs)
    assert orjson.loads(light.backend_tokenizer.to_str()) == orjson.loads(theirs.backend_tokenizer.to_str())


def test_everything_the_build_reads_is_transformers(pair):
    light, theirs = pair
    assert len(light) == len(theirs)
    assert light.special_tokens_map == theirs.special_tokens_map
    assert light.chat_template == theirs.chat_template
    assert light.eos_token_id == theirs.eos_token_id
    for flag in ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces", "split_special_tokens"):
        assert getattr(light, flag) == getattr(theirs, flag), flag
    assert light.backend_tokenizer.encode_special_tokens == theirs.backend_tokenizer.encode_special_tokens

    def state(tokenizer):
        return {i: t.__getstate__() for i, t in tokenizer.added_tokens_decoder.items()}

    assert state(light) == state(theirs)
    for token in [*theirs.special_tokens_map.values(), "<nope>", "hello"]:
        assert light.convert_tokens_to_ids(token) == theirs.convert_tokens_to_ids(token), token


@pytest.mark.parametrize("add_special_tokens", [True, False])
def test_token_ids_are_transformers(pair, add_special_tokens):
    light, theirs = pair
    for text in TEXTS:
        ours = light.backend_tokenizer.encode(text, add_special_tokens=add_special_tokens).ids
        assert ours == theirs.encode(text, add_special_tokens=add_special_tokens), text


def _outcome(call, *args, **kwargs):
    """What `call(*args, **kwargs)` returns, or the type and message of what it raises."""
    try:
        return call(*args, **kwargs)
    except Exception as e:  # noqa: BLE001 - both sides must fail the same way
        return (type(e).__name__, str(e))


def _conversations():
    rows = [(messages, None) for messages in [*CONVERSATIONS, REASONING]]
    for row in TOOL_ROWS.values():
        tools = row.get("tools")
        tools = json.loads(tools) if isinstance(tools, str) else tools
        rows.append(((row.get("prompt") or []) + row["chosen"], tools))
    return rows


def test_chat_templates_render_as_transformers(pair):
    light, theirs = pair
    mine, other = ChatRenderer(light), ChatRenderer(theirs)
    for messages, tools in _conversations():
        for generation in (True, False):
            for tokenize in (False, True):
                kwargs = {"tools": tools, "tokenize": tokenize, "add_generation_prompt": generation}
                ours = _outcome(light.apply_chat_template, messages, return_dict=False, **kwargs)
                assert ours == _outcome(theirs.apply_chat_template, messages, return_dict=False, **kwargs)
            ours = _outcome(mine.render, messages, generation, tools)
            expected = _outcome(other.render, messages, generation, tools)
            if isinstance(expected, tuple):  # a reject: the same reason and message
                assert expected[0] == "RowReject" and ours == expected
                assert _reject(mine, messages, generation, tools) == _reject(other, messages, generation, tools)
            else:
                assert ours == expected


def _reject(renderer, messages, generation, tools):
    """The reason and message of the reject `renderer` makes of the conversation, None when it renders it."""
    try:
        renderer.render(messages, generation, tools)
    except RowReject as reject:
        return reject.reason, reject.message
    return None


def _rows():
    rows = [
        {"prompt": "2 + 2?", "chosen": " 4", "rejected": " 5"},
        {"prompt": "say <|im_end|>", "chosen": " <|im_end|> said", "rejected": " no"},
        {"prompt": CONVERSATIONS[2], "chosen": [{"role": "assistant", "content": "It is 4."}], "rejected": "x"},
    ]
    rows += [
        {
            "prompt": [{"role": "user", "content": q}],
            "chosen": [{"role": "assistant", "content": a}],
            "rejected": [{"role": "assistant", "content": "no <|im_start|>"}],
        }
        for q, a in [("hi", "hello"), ("<|im_end|> in content", "ok"), ("!think", "fine")]
    ]
    return [*rows, *TOOL_ROWS.values()]


def _encoded(tokenizer):
    encoder = PairEncoder(tokenizer, TokenizeOptions())
    out = []
    for row in _rows():
        try:
            out.append(encoder.encode_many([normalize_row(dict(row))])[0])
        except RowReject as reject:
            out.append(reject)
    return [(r.reason, r.message) if isinstance(r, RowReject) else r for r in out]


def test_pairs_encode_to_transformers_ids(pair):
    light, theirs = pair
    assert _encoded(light) == _encoded(theirs)


# -- directories left to transformers ---------------------------------------------------------------


def _with(key, value):
    def make(smollm2_dir, tmp_path):
        d = _copy(smollm2_dir, tmp_path, "refused")
        _edit_json(d / "tokenizer_config.json", **{key: value})
        return d

    return make


def _file(name, text):
    def make(smollm2_dir, tmp_path):
        d = _copy(smollm2_dir, tmp_path, "refused")
        (d / name).parent.mkdir(exist_ok=True)
        (d / name).write_text(text)
        return d

    return make


def _truncating(smollm2_dir, tmp_path):
    d = _copy(smollm2_dir, tmp_path, "refused")
    spec = json.loads((d / "tokenizer.json").read_text())
    spec["truncation"] = {"direction": "Right", "max_length": 8, "strategy": "LongestFirst", "stride": 0}
    (d / "tokenizer.json").write_text(json.dumps(spec))
    return d


def _model_type(model_type):
    def make(smollm2_dir, tmp_path):
        d = _copy(smollm2_dir, tmp_path, "refused")
        (d / "config.json").write_text(json.dumps({"model_type": model_type}))
        return d

    return make


REFUSED = {
    "an unknown key": (_with("fancy_new_option", True), "'fancy_new_option'"),
    "a model-specific token": (_with("image_token", "<image>"), "'image_token'"),
    "a special token given as an AddedToken": (
        _with("bos_token", {"__type": "AddedToken", "content": "<|im_start|>", "special": True}),
        "'bos_token'",
    ),
    "a flag that is not a boolean": (_with("split_special_tokens", "yes"), "'split_special_tokens'"),
    "extra special tokens by name": (_with("extra_special_tokens", {"tool": "<|tool|>"}), "'extra_special_tokens'"),
    "a slow tokenizer class": (_with("tokenizer_class", "LlamaTokenizer"), "not the generic fast class"),
    "remote code": (_with("auto_map", {"AutoTokenizer": ["x.X", None]}), "not the generic fast class"),
    "a model type outside the set": (_model_type("qwen2"), "not the generic fast class"),
    "a legacy special_tokens_map.json": (_file("special_tokens_map.json", "{}"), "legacy special_tokens_map.json"),
    "a legacy added_tokens.json": (_file("added_tokens.json", "{}"), "legacy added_tokens.json"),
    "truncation in tokenizer.json": (_truncating, "truncation or padding"),
    "an extra template named 'file'": (_file("additional_chat_templates/file.jinja", "x"), "file.jinja"),
}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_what_the_light_reader_does_not_reproduce_goes_to_transformers(name, smollm2_dir, tmp_path):
    make, says = REFUSED[name]
    directory = make(smollm2_dir, tmp_path)
    assert says in refusal(directory)
    assert read_light(directory) is None


def test_a_refused_generic_directory_loads_as_before(smollm2_dir, tmp_path):
    """The load that transformers' generic class does without torch is kept for what the light reader refuses."""
    from transformers import AutoTokenizer

    directory = _file("special_tokens_map.json", "{}")(smollm2_dir, tmp_path)
    ours, theirs = load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    assert type(ours) is type(theirs) and not isinstance(ours, LightTokenizer)
    assert tokenizer_attestation(ours) == tokenizer_attestation(theirs)


def test_another_transformers_major_version_is_left_to_it(smollm2_dir, monkeypatch):
    from dpo_data.tokenizer import light

    monkeypatch.setattr(light.metadata, "version", lambda name: "6.0.0")
    assert "transformers 6.0.0, not 5.x" in refusal(smollm2_dir)


def test_transformers_options_are_refused_not_passed_to_the_template(smollm2_dir):
    light = read_light(smollm2_dir)
    with pytest.raises(TypeError, match="continue_final_message"):
        light.apply_chat_template([{"role": "user", "content": "q"}], continue_final_message=True)


# -- the Jinja environment --------------------------------------------------------------------------

ENVIRONMENT_OPTIONS = (
    "block_start_string",
    "block_end_string",
    "variable_start_string",
    "variable_end_string",
    "comment_start_string",
    "comment_end_string",
    "line_statement_prefix",
    "line_comment_prefix",
    "trim_blocks",
    "lstrip_blocks",
    "newline_sequence",
    "keep_trailing_newline",
    "optimized",
    "undefined",
    "finalize",
    "autoescape",
    "is_async",
    "sandboxed",
    "policies",
    "tests",
)
OWN = {"tojson", "raise_exception", "strftime_now", "dict", "namespace"}
"""Filters and globals both environments define themselves (the rest are Jinja's own objects)."""

TEMPLATES = [
    "{% for m in messages %}\n  {{ m.content }}\n  {%- if not loop.last %}, {% endif %}\n{% endfor %}\n",
    "  {% if true %}\n    x\n  {% endif %}\ny\n",
    "{{ data | tojson }}|{{ data | tojson(indent=2) }}|{{ data | tojson(2) }}",
    "{{ data | tojson(separators=(',', ':'), sort_keys=true) }}|{{ '<&>é' | tojson }}|{{ 'é' | tojson(true) }}",
    "{{ raise_exception('bad role: ' ~ messages[0].role) }}",
    "{% set ns = namespace(a=1, self=2) %}{% set ns.b = 3 %}{{ ns.a + ns.b + ns.self }}",
    "{% set ns = namespace(_hidden=1) %}{{ ns }}",
    "{% set ns = namespace() %}{% set ns._hidden = 1 %}{{ ns }}",
    "{{ dict(a=1, b=[2]) | tojson }}{{ dict.fromkeys(['x', 'y'], 0) | tojson }}",
    "{{ strftime_now('%Y') }}",
    "{% for m in messages %}{% generation %} <{{ m.content }}> {% endgeneration %}{% endfor %}",
    "{% for i in range(6) %}{% if i == 4 %}{% break %}{% endif %}{% if i == 1 %}{% continue %}{% endif %}{{ i }}"
    "{% endfor %}",
    "{% set x = [] %}{{ x.append(1) }}",
    "{{ ''.__class__.__mro__ }}",
    "{{ missing }}|{{ missing is defined }}|{{ messages[0].nothing is defined }}",
    "{{ messages | map(attribute='content') | join(', ') | upper }}{{ (messages | length) * 2 }}",
    "a\n",
    "{{ messages[0]['content'] | trim | replace('a', 'b') }}{{ 'x' if add_generation_prompt else 'y' }}",
]


def _theirs_environment():
    from transformers.utils.chat_template_utils import _compile_jinja_template

    return _compile_jinja_template("").environment


def test_the_environment_has_transformers_options_filters_globals_and_tags():
    ours, theirs = chat_environment(), _theirs_environment()
    assert type(ours) is type(theirs)
    for option in ENVIRONMENT_OPTIONS:
        assert getattr(ours, option) == getattr(theirs, option), option
    assert ours.filters.keys() == theirs.filters.keys() and ours.globals.keys() == theirs.globals.keys()
    for name in ours.filters.keys() - OWN:
        assert ours.filters[name] is theirs.filters[name], name
    for name in ours.globals.keys() - OWN:
        assert ours.globals[name] is theirs.globals[name], name

    def tags(env):
        return sorted(tag for extension in env.extensions.values() for tag in extension.tags)

    assert tags(ours) == tags(theirs) == ["break", "continue", "generation"]


@pytest.mark.parametrize("source", TEMPLATES)
def test_templates_render_as_in_transformers_environment(source):
    variables = {
        "messages": [{"role": "user", "content": " a b "}, {"role": "assistant", "content": "c"}],
        "data": {"z": [1, 2.5, None, True], "a": "<é>"},
        "add_generation_prompt": True,
    }

    def render(env):
        return _outcome(lambda: env.from_string(source).render(**variables))

    assert render(chat_environment()) == render(_theirs_environment())
