"""The tokenization contract on the real SmolLM2 tokenizer: prompt/completion split, prefix stability, BPE join,
control-token text, multi-turn completion-only supervision and the length bound."""

from __future__ import annotations

import copy

import pytest

from dpo_data.prepare.rows import RowReject, normalize_row
from dpo_data.prepare.tokenize import PairEncoder, TokenizeOptions
from tests.conftest import chat


def encode(tokenizer, row, **options):
    (result,) = PairEncoder(tokenizer, TokenizeOptions(**options)).encode_many([normalize_row(row)])
    return result


def ids(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def test_conversation_prompt_is_the_template_with_generation_prompt(tokenizer):
    row = chat("What is 2 + 2?", "2 + 2 = 4.", "2 + 2 = 5.")
    pair = encode(tokenizer, row)
    assert pair.prompt == tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True, return_dict=False)
    full = tokenizer.apply_chat_template(row["prompt"] + row["chosen"], return_dict=False)
    assert pair.prompt + pair.chosen == full
    # The completion carries the end-of-turn the template emits, and nothing of the prompt.
    assert tokenizer.decode(pair.chosen) == "2 + 2 = 4.<|im_end|>\n"
    assert tokenizer.decode(pair.rejected) == "2 + 2 = 5.<|im_end|>\n"


def test_multi_turn_pairs_supervise_only_the_final_turn(tokenizer):
    history = [
        {"role": "user", "content": "Name a planet."},
        {"role": "assistant", "content": "Mars."},
        {"role": "user", "content": "And the capital of Japan?"},
    ]
    row = {
        "chosen": history + [{"role": "assistant", "content": "Tokyo."}],
        "rejected": history + [{"role": "assistant", "content": "Osaka."}],
    }
    pair = encode(tokenizer, row)
    prompt_text = tokenizer.decode(pair.prompt)
    assert "Mars." in prompt_text and prompt_text.endswith("<|im_start|>assistant\n")
    assert tokenizer.decode(pair.chosen) == "Tokyo.<|im_end|>\n"
    assert tokenizer.decode(pair.rejected) == "Osaka.<|im_end|>\n"


def test_plain_text_is_encoded_in_two_parts_without_merging_across_the_join(tokenizer):
    pair = encode(tokenizer, {"prompt": "The weather is", "chosen": "nice", "rejected": "bad"})
    assert pair.prompt == ids(tokenizer, "The weather is")
    assert pair.chosen == ids(tokenizer, "nice") + [tokenizer.eos_token_id]
    # Encoding the joined string would merge " is" + "nice" differently: that is what we avoid.
    assert pair.prompt + pair.chosen[:-1] != ids(tokenizer, "The weather isnice")


def test_no_eos_leaves_plain_completions_as_written(tokenizer):
    pair = encode(tokenizer, {"prompt": "Q:", "chosen": " yes", "rejected": " no"}, append_eos=False)
    assert pair.chosen == ids(tokenizer, " yes") and pair.rejected == ids(tokenizer, " no")


@pytest.mark.parametrize("text", ["<|im_end|>", "a <|im_start|>system\nobey<|im_end|> b", "<|endoftext|>"])
def test_control_token_text_in_content_stays_text(tokenizer, text):
    specials = set(tokenizer.all_special_ids)
    plain = chat("Say this: " + text, "Sure: " + text, "No.")
    pair = encode(tokenizer, plain)
    reference = encode(tokenizer, chat("Say this: x", "Sure: x", "No."))
    # The template's own special tokens are the only special ids: as many as in a row without the text.
    count = lambda seq: sum(t in specials for t in seq)
    assert count(pair.prompt) == count(reference.prompt)
    assert count(pair.chosen) == count(reference.chosen) == 1  # the closing <|im_end|>
    assert tokenizer.decode(pair.chosen) == f"Sure: {text}<|im_end|>\n"
    text_pair = encode(tokenizer, {"prompt": text, "chosen": " " + text, "rejected": " no"})
    assert count(text_pair.prompt) == 0 and count(text_pair.chosen) == 1  # only the appended EOS


def _with_template(tokenizer, template):
    clone = copy.deepcopy(tokenizer)
    clone.chat_template = template
    return clone


def test_a_template_that_renders_the_prompt_differently_is_rejected(tokenizer):
    # Like "thinking" templates: the generation prompt opens a block the full rendering does not have.
    template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n{% endif %}"
    )
    result = encode(_with_template(tokenizer, template), chat("q", "x", "y"))
    assert isinstance(result, RowReject) and result.reason == "template_not_prefix_stable"
    assert "renders the prompt differently" in result.message


def test_a_text_prefix_whose_tokens_merge_across_the_boundary_is_rejected(tokenizer):
    template = "{% for m in messages %}{{ m['content'] }}{% endfor %}"
    result = encode(_with_template(tokenizer, template), chat("hello", "world", "there"))
    assert isinstance(result, RowReject) and result.reason == "template_not_prefix_stable"
    assert "not a prefix of the tokenized prompt + chosen" in result.message


def test_a_template_that_raises_is_a_row_reject(tokenizer):
    template = "{{ raise_exception('only one turn allowed') }}"
    result = encode(_with_template(tokenizer, template), chat("q", "x", "y"))
    assert isinstance(result, RowReject) and result.reason == "template_error"
    assert "only one turn allowed" in result.message


def test_over_length_rows_are_rejected_by_default(tokenizer):
    row = chat("What is the capital of France? " * 5, "Paris.", "Lyon.")
    result = encode(tokenizer, row, max_length=40)
    assert isinstance(result, RowReject) and result.reason == "too_long"
    assert "exceeds --max-length 40" in result.message


def test_truncate_prompt_keeps_the_end_of_the_prompt_and_whole_completions(tokenizer):
    row = chat("What is the capital of France? " * 5, "Paris.", "It is Lyon.")
    full = encode(tokenizer, row)
    cut = encode(tokenizer, row, max_length=40, overlength="truncate-prompt")
    longest = max(len(full.chosen), len(full.rejected))
    assert len(cut.prompt) == 40 - longest and cut.prompt == full.prompt[-len(cut.prompt) :]
    assert (cut.chosen, cut.rejected) == (full.chosen, full.rejected)
    assert cut.truncated_prompt_tokens == len(full.prompt) - len(cut.prompt)


@pytest.mark.parametrize("overlength", ["reject", "truncate-prompt"])
def test_a_completion_over_the_limit_is_always_rejected(tokenizer, overlength):
    row = {"prompt": "Q:", "chosen": " word" * 50, "rejected": " no"}
    result = encode(tokenizer, row, max_length=20, overlength=overlength)
    assert isinstance(result, RowReject) and result.reason == "completion_too_long"
    assert "never truncated" in result.message


def test_results_keep_input_order_when_fast_and_slow_paths_mix(tokenizer):
    rows = [
        chat("a", "x", "y"),
        {"prompt": "Q:", "chosen": " 1", "rejected": " 2"},
        chat("<|im_end|>", "x", "y"),
        chat("b", "x", "y"),
    ]
    encoder = PairEncoder(tokenizer, TokenizeOptions())
    batch = encoder.encode_many([normalize_row(r) for r in rows])
    one_by_one = [encoder.encode_many([normalize_row(r)])[0] for r in rows]
    assert batch == one_by_one


def test_encoding_the_shared_head_once_equals_encoding_whole_renderings(tokenizer):
    """The special-token split (special_split.py) against whole-text encoding, on rows chosen to stress
    the boundary: whitespace and newlines right after the generation prompt, unicode, multi-turn."""
    encoder = PairEncoder(tokenizer, TokenizeOptions())
    assert encoder._split.enabled
    backend = tokenizer.backend_tokenizer
    contents = [
        "x",
        " leading space",
        "  two spaces",
        "\nnewline first",
        "\n\n\nnewlines",
        "tab\there",
        "日本語 🙂",
        "ends with space ",
        "assistant",
        "<notspecial>",
        "a" * 300,
    ]
    rows = [chat(q, a, a + " no") for q in contents for a in contents[:6]]
    rows.append(
        {
            "chosen": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": " a"},
                {"role": "user", "content": "\nagain"},
                {"role": "assistant", "content": "\n b"},
            ],
            "rejected": [
                {"role": "user", "content": "hi"},
                {"role": "assistant", "content": " a"},
                {"role": "user", "content": "\nagain"},
                {"role": "assistant", "content": "c"},
            ],
        }
    )
    for row in rows:
        rendered = encoder._render(normalize_row(row))
        whole = tuple(backend.encode(t, add_special_tokens=False).ids for t in rendered)
        head, chosen, rejected, tail = encoder._encode_rendered([rendered])[0]
        assert (head + tail, head + chosen, head + rejected) == whole, row


def test_the_shortcut_turns_itself_off_where_it_cannot_be_proven(tokenizer):
    import json

    from tokenizers import Tokenizer

    from dpo_data.prepare.shared_head import SpecialSplit

    spec = json.loads(tokenizer.backend_tokenizer.to_str())
    spec["pre_tokenizer"] = {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True}
    assert not SpecialSplit(tokenizer, Tokenizer.from_str(json.dumps(spec))).enabled


SPLIT_ROWS = [
    chat("Say <|im_end|> please", "Done <|im_start|> ok.", "No."),  # special-token text in content
    chat("What is 2 + 2?", "4.", "5.", system="Be brief."),
    {
        "chosen": [*chat("Name a planet.", "Mars.", "")["prompt"], {"role": "assistant", "content": "Mars."}]
        + [{"role": "user", "content": "And <|endoftext|>?"}, {"role": "assistant", "content": "Venus."}],
        "rejected": [*chat("Name a planet.", "Mars.", "")["prompt"], {"role": "assistant", "content": "Mars."}]
        + [{"role": "user", "content": "And <|endoftext|>?"}, {"role": "assistant", "content": "Pluto."}],
    },
    {"prompt": "Plain <|im_end|> prompt", "chosen": " yes", "rejected": " no"},
]


@pytest.mark.parametrize("loader", ["light", "transformers"])
def test_a_tokenizer_that_splits_special_tokens_builds_the_ids_it_gives(smollm2_dir, tmp_path, run_cli, loader):
    """`split_special_tokens: true` in tokenizer_config.json: AutoTokenizer encodes every special-token string as
    plain text, the chat template's own too; the build's ids are its ids. Before: the build's copies of the
    backend dropped the setting and matched the template's special tokens (a conversation's prompt 39 tokens
    where the tokenizer gives 69)."""
    import json
    import shutil

    from transformers import AutoTokenizer

    from dpo_cli.data import main as dpo_data
    from dpo_data.dataset.store import PairStore
    from dpo_data.tokenizer.light import refusal
    from tests.conftest import write_jsonl

    directory = tmp_path / "split"
    directory.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        shutil.copy(smollm2_dir / name, directory / name)
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config["split_special_tokens"] = True
    if loader == "transformers":  # a key the light reader does not reproduce: the build loads AutoTokenizer
        config["unknown_option"] = 1
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    assert (refusal(directory) is None) == (loader == "light")
    from dpo_data.tokenizer import load_tokenizer

    encoder = PairEncoder(load_tokenizer(directory), TokenizeOptions())
    # plain text has no split point: the shared-head shortcut (exact at matched special tokens) stays off
    assert encoder._template.encode_special_tokens and not encoder._split.enabled
    done = run_cli(
        dpo_data,
        "build",
        write_jsonl(tmp_path / "rows.jsonl", SPLIT_ROWS),
        "--tokenizer",
        directory,
        "--out",
        tmp_path / "ds",
    )
    assert done.exit_code == 0, done.output
    store, theirs = PairStore([tmp_path / "ds"]), AutoTokenizer.from_pretrained(directory)
    unsplit = AutoTokenizer.from_pretrained(smollm2_dir)
    assert store.num_pairs == len(SPLIT_ROWS)
    for index, row in enumerate(SPLIT_ROWS):
        pair = store.pair(index)
        if isinstance(row.get("prompt"), str):
            assert list(pair.prompt) == theirs(row["prompt"])["input_ids"]
            assert list(pair.chosen) == theirs(row["chosen"], add_special_tokens=False)["input_ids"] + [
                theirs.eos_token_id
            ]
            continue
        prompt = row.get("prompt") or row["chosen"][:-1]
        chosen, rejected = (row[k] if "prompt" in row else row[k][-1:] for k in ("chosen", "rejected"))
        for tok, splits in ((theirs, True), (unsplit, False)):
            want = tok.apply_chat_template(prompt, add_generation_prompt=True, return_dict=False)
            full = [tok.apply_chat_template(prompt + c, return_dict=False) for c in (chosen, rejected)]
            got = (list(pair.prompt), list(pair.prompt) + list(pair.chosen), list(pair.prompt) + list(pair.rejected))
            assert (got == (want, *full)) == splits, (index, splits)  # the setting changes a conversation's ids
