"""Row normalization: explicit and implicit prompts, text and conversations, and every row-level reject reason."""

from __future__ import annotations

import pytest

from dpo_data.prepare.rows import RowReject, normalize_row


def u(text):
    return {"role": "user", "content": text}


def a(text):
    return {"role": "assistant", "content": text}


def s(text):
    return {"role": "system", "content": text}


def test_explicit_text_row_is_a_text_pair():
    pair = normalize_row({"prompt": "Q?", "chosen": " yes", "rejected": " no", "id": 7, "source": "web"})
    assert (pair.kind, pair.prompt, pair.chosen, pair.rejected, pair.id, pair.source) == (
        "text",
        "Q?",
        " yes",
        " no",
        "7",
        "web",
    )


def test_implicit_prompt_is_the_shared_history_of_a_multi_turn_conversation():
    history = [s("be brief"), u("2+2?"), a("4."), u("and 3+3?")]
    pair = normalize_row({"chosen": history + [a("6.")], "rejected": history + [a("7.")]})
    assert pair.kind == "chat" and pair.prompt == history and pair.form == "implicit-chat"
    assert (pair.chosen, pair.rejected) == ([a("6.")], [a("7.")])


HH_HISTORY = "\n\nHuman: What is 2 + 2?\n\nAssistant: 4.\n\nHuman: And 3 + 3?\n\nAssistant:"


def test_hh_rlhf_texts_are_split_at_their_final_assistant_turn():
    """Anthropic HH-RLHF's shape: chosen and rejected full texts; the prompt is the shared text through the final
    '\\n\\nAssistant:', each completion the answer after it (its leading space included, as TRL leaves it)."""
    pair = normalize_row({"chosen": HH_HISTORY + " 6.", "rejected": HH_HISTORY + " Seven.", "id": 3})
    assert (pair.kind, pair.form, pair.prompt, pair.chosen, pair.rejected, pair.id) == (
        "text",
        "implicit-text",
        HH_HISTORY,
        " 6.",
        " Seven.",
        "3",
    )


def test_hh_answers_that_open_alike_keep_their_shared_opening_in_both_completions():
    """TRL's character prefix would run into the answers (prompt '...Assistant: It is'); the split stays at the turn."""
    pair = normalize_row({"chosen": HH_HISTORY + " It is 6.", "rejected": HH_HISTORY + " It is 7."})
    assert (pair.prompt, pair.chosen, pair.rejected) == (HH_HISTORY, " It is 6.", " It is 7.")


def test_an_hh_row_without_a_shared_assistant_turn_names_the_shared_text_and_the_fix():
    with pytest.raises(RowReject) as info:
        normalize_row({"chosen": "\n\nHuman: hi\n\nAssistant: yo", "rejected": "\n\nHuman: hey\n\nAssistant: yo"})
    assert (info.value.reason, info.value.message) == (
        "no_implicit_prompt",
        "without 'prompt', plain-text chosen and rejected are split where their shared text ends at an assistant turn "
        "('\\n\\nAssistant:'), but the 10 characters they share ('\\n\\nHuman: h') hold none; fix: give the prompt as "
        "a 'prompt' field (or map one with --columns), or write each turn as 'Human: ...' / 'Assistant: ...' after a "
        "blank line as HH-RLHF does",
    )


def test_each_row_form_is_named_on_its_pair():
    forms = [
        normalize_row(row).form
        for row in (
            {"prompt": "Q", "chosen": " a", "rejected": " b"},
            {"prompt": [u("q")], "chosen": [a("x")], "rejected": [a("y")]},
            {"prompt": "q", "chosen": [u("q"), a("x")], "rejected": [u("q"), a("y")]},
            {"chosen": [u("q"), a("x")], "rejected": [u("q"), a("y")]},
            {"chosen": HH_HISTORY + " 6.", "rejected": HH_HISTORY + " 7."},
        )
    ]
    assert forms == ["explicit-text", "explicit-chat", "whole-conversations", "implicit-chat", "implicit-text"]


def test_a_string_prompt_after_the_conversations_system_message_is_their_user_turn():
    """TRL 1.16's maybe_extract_prompt drops such a string prompt and takes the shared [system, user] prefix; here
    the same turns are the prompt, and the user turn must be the string."""
    row = {
        "prompt": "2+2?",
        "chosen": [s("be brief"), u("2+2?"), a("4.")],
        "rejected": [s("be brief"), u("2+2?"), a("5.")],
    }
    pair = normalize_row(row)
    assert (pair.form, pair.prompt, pair.chosen, pair.rejected) == (
        "whole-conversations",
        [s("be brief"), u("2+2?")],
        [a("4.")],
        [a("5.")],
    )


def test_a_string_prompt_after_differing_system_messages_names_the_message_and_the_fix():
    with pytest.raises(RowReject) as info:
        normalize_row({"prompt": "q", "chosen": [s("A"), u("q"), a("x")], "rejected": [s("B"), u("q"), a("y")]})
    assert (info.value.reason, info.value.message) == (
        "prompt_not_prefix",
        "field 'rejected' is a whole conversation but does not begin with chosen's system message, then the string "
        "'prompt' as one user turn: rejected[0] is {'role': 'system', 'content': 'B'}, the prompt's turn 0 is "
        "{'role': 'system', 'content': 'A'}; fix: make the prompt the conversations' leading turns, or drop 'prompt' "
        "(--columns prompt= reads none) so their shared prefix is the prompt",
    )


REJECTS = [
    ("not_an_object", [1, 2]),
    ("missing_field", {"prompt": "Q", "chosen": " a"}),
    ("no_implicit_prompt", {"chosen": " a", "rejected": " b"}),  # plain text without an assistant turn to split at
    ("no_implicit_prompt", {"chosen": "Q\n\nAssistant: a", "rejected": "R\n\nAssistant: b"}),
    (
        "history_diverges",
        {"chosen": "\n\nHuman: q\n\nAssistant: a\n\nHuman: more", "rejected": "\n\nHuman: q\n\nAssistant: b"},
    ),
    ("empty_completion", {"chosen": "\n\nHuman: q\n\nAssistant: ", "rejected": "\n\nHuman: q\n\nAssistant: b"}),
    ("identical_completions", {"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": "\n\nHuman: q\n\nAssistant: a"}),
    ("mixed_formats", {"chosen": "\n\nHuman: q\n\nAssistant: a", "rejected": [u("q"), a("b")]}),
    ("wrong_type", {"prompt": "Q", "chosen": 3, "rejected": " b"}),
    ("wrong_type", {"prompt": [u("q")], "chosen": [{"role": "assistant"}], "rejected": [a("b")]}),
    ("wrong_type", {"prompt": [u("q")], "chosen": [a(["parts"])], "rejected": [a("b")]}),
    ("wrong_type", {"prompt": "Q", "chosen": " a", "rejected": " b", "source": 5}),
    ("wrong_type", {"prompt": "Q", "chosen": " a", "rejected": " b", "id": {"x": 1}}),
    ("mixed_formats", {"prompt": "Q", "chosen": [a("x")], "rejected": [a("y")]}),
    ("empty_prompt", {"prompt": "  ", "chosen": " a", "rejected": " b"}),
    ("empty_prompt", {"prompt": [], "chosen": [a("x")], "rejected": [a("y")]}),
    ("empty_completion", {"prompt": "Q", "chosen": "", "rejected": " b"}),
    ("empty_completion", {"prompt": [u("q")], "chosen": [a("  ")], "rejected": [a("y")]}),
    ("identical_completions", {"prompt": "Q", "chosen": " same", "rejected": " same"}),
    ("identical_completions", {"chosen": [u("q"), a("x")], "rejected": [u("q"), a("x")]}),
    ("unknown_role", {"prompt": [{"role": "narrator", "content": "q"}], "chosen": [a("x")], "rejected": [a("y")]}),
    ("roles_out_of_order", {"prompt": [u("q"), s("late system")], "chosen": [a("x")], "rejected": [a("y")]}),
    ("roles_out_of_order", {"prompt": [u("q"), u("q2")], "chosen": [a("x")], "rejected": [a("y")]}),
    ("roles_out_of_order", {"prompt": [a("hi")], "chosen": [a("x")], "rejected": [a("y")]}),
    ("roles_out_of_order", {"prompt": [u("q")], "chosen": [u("x")], "rejected": [a("y")]}),
    ("history_diverges", {"chosen": [u("q"), a("x"), u("q2"), a("z")], "rejected": [u("q"), a("y"), u("q2"), a("z")]}),
    ("history_diverges", {"chosen": [u("q"), a("x")], "rejected": [u("other"), a("x")]}),
    ("history_diverges", {"chosen": [u("q"), a("x")], "rejected": [u("q"), a("x"), u("more"), a("y")]}),
    ("prompt_not_prefix", {"prompt": "q", "chosen": [u("q"), a("x")], "rejected": [u("Q"), a("y")]}),
    (
        "prompt_not_prefix",
        {"prompt": [s("sys"), u("q")], "chosen": [s("sys"), u("q2"), a("x")], "rejected": [s("sys")]},
    ),
    ("empty_prompt", {"prompt": " ", "chosen": [u(" "), a("x")], "rejected": [u(" "), a("y")]}),
    ("empty_completion", {"prompt": "q", "chosen": [u("q")], "rejected": [u("q"), a("y")]}),
    ("identical_completions", {"prompt": "q", "chosen": [u("q"), a("x")], "rejected": [u("q"), a("x")]}),
    ("roles_out_of_order", {"prompt": "q", "chosen": [u("q"), u("x")], "rejected": [u("q"), a("y")]}),
]


@pytest.mark.parametrize("reason, row", REJECTS, ids=[f"{r}-{i}" for i, (r, _) in enumerate(REJECTS)])
def test_bad_rows_are_rejected_with_their_reason(reason, row):
    with pytest.raises(RowReject) as info:
        normalize_row(row)
    assert info.value.reason == reason
    assert info.value.message  # a human message accompanies every code


def test_a_string_prompt_with_whole_conversations_is_their_first_user_turn():
    """The UltraFeedback-binarized shape: `prompt` a string, `chosen`/`rejected` whole conversations that open
    with it as a user turn; the completions are what follows it."""
    row = {"prompt": "2+2?", "chosen": [u("2+2?"), a("4.")], "rejected": [u("2+2?"), a("5.")], "score_chosen": 8.0}
    pair = normalize_row(row)
    assert (pair.kind, pair.prompt, pair.chosen, pair.rejected) == ("chat", [u("2+2?")], [a("4.")], [a("5.")])


def test_a_message_prompt_with_whole_conversations_strips_those_turns():
    history = [s("be brief"), u("2+2?"), a("4."), u("and 3+3?")]
    pair = normalize_row(
        {"prompt": history, "chosen": history + [a("6.")], "rejected": history + [a("7."), u("?"), a("6.")]}
    )
    assert (pair.prompt, pair.chosen, pair.rejected) == (history, [a("6.")], [a("7."), u("?"), a("6.")])


def test_whole_conversations_that_do_not_begin_with_the_prompt_name_the_first_differing_message():
    with pytest.raises(RowReject) as info:
        normalize_row({"prompt": "2+2?", "chosen": [u("2+2?"), a("4.")], "rejected": [u("2+3?"), a("5.")]})
    assert info.value.reason == "prompt_not_prefix"
    assert info.value.message.startswith(
        "field 'rejected' is a whole conversation but does not begin with the string 'prompt' as one user turn: "
        "rejected[0] is {'role': 'user', 'content': '2+3?'}, the prompt's turn 0 is "
        "{'role': 'user', 'content': '2+2?'}; fix: "
    )


def test_completion_lists_beside_a_string_prompt_stay_mixed_formats():
    """Lists that open with an assistant turn are completions, not conversations: the old reject stands."""
    with pytest.raises(RowReject) as info:
        normalize_row({"prompt": "q", "chosen": [a("x")], "rejected": [u("q"), a("y")]})
    assert info.value.reason == "mixed_formats"


def test_reject_messages_name_the_field_and_the_fix():
    with pytest.raises(RowReject, match=r"field 'rejected' is missing; every row needs 'chosen' and 'rejected'"):
        normalize_row({"prompt": "Q", "chosen": " a"})
    with pytest.raises(
        RowReject, match=r"chosen\[0\]\.role is 'narrator'; allowed roles are system, user, assistant, tool"
    ):
        normalize_row({"prompt": [u("q")], "chosen": [{"role": "narrator", "content": "x"}], "rejected": [a("y")]})
