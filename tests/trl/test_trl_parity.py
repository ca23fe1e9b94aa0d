"""Token-id parity with TRL 1.16's own DPO dataset preparation, on the real SmolLM2 tokenizer.

For every row format TRL accepts (plain-text explicit prompt; conversational explicit prompt with single- and
multi-turn histories, with and without a system message; conversational implicit prompt) our `PairEncoder` must
produce exactly the prompt / chosen / rejected ids that `DPOTrainer` itself stores as `prompt_ids` / `chosen_ids` /
`rejected_ids`. The reference ids come from TRL's code, never from a re-implementation of it here.

How TRL is invoked: a real `DPOTrainer` is constructed once per module with a tiny randomly initialised Llama
(hidden 64, 2 layers, SmolLM2's vocabulary of 49152) as policy and as reference model, on CPU. Its `__init__` calls
`DPOTrainer._prepare_dataset` on `train_dataset` and on each entry of an `eval_dataset` dict, so the ids we compare
against are the ones TRL's public entry point produces (prompt extraction, EOS text appended to plain-text
completions, `_tokenize`, the common-prefix split), including whatever `__init__` does to the tokenizer first (e.g.
the pad token). This costs about 0.2 s beyond the imports, so it is preferred over a `DPOTrainer.__new__` shell with
hand-set private attributes, which would silently go stale if `_prepare_dataset` started reading other state.
TRL decides per dataset, from its first example, whether to extract an implicit prompt and whether the rows are
conversational, so each format is passed as its own dataset. `max_length=None` so TRL drops no row.

Two documented differences, each asserted precisely rather than merely tolerated:
- plain text whose prompt/completion join merges under BPE: TRL tokenizes the concatenated string and cuts the
  prompt back to the common prefix; we encode prompt and completion separately (the prompt stays whole);
- a conversation whose completion merges with the template's generation prompt: TRL truncates the prompt the same
  way; we reject the row as not prefix-stable.
"""

from __future__ import annotations

import warnings

import pytest

from dpo_data.prepare.rows import RowReject, normalize_row
from dpo_data.prepare.tokenize import EncodedPair, PairEncoder, TokenizeOptions


def user(content: str) -> dict:
    return {"role": "user", "content": content}


def assistant(content: str) -> dict:
    return {"role": "assistant", "content": content}


def system(content: str) -> dict:
    return {"role": "system", "content": content}


def tool(content: str) -> dict:
    return {"role": "tool", "content": content}


# -- rows ------------------------------------------------------------------------------------------
# Plain text: TRL tokenizes prompt and prompt + completion + "<|im_end|>" as single strings, so every prompt here
# ends on a pre-tokenizer boundary (punctuation, a letter, a newline) and every completion starts with one space
# followed by a non-space character: no BPE merge can cross the join, and both tokenizations must agree exactly.
TEXT_ROWS = [
    {"prompt": "Q: What is 2 + 2?\nA:", "chosen": " 4", "rejected": " 5"},
    {"prompt": "Q: What is the capital of France?\nA:", "chosen": " Paris.", "rejected": " Lyon, I think."},
    {"prompt": "Translate to French: good morning\nA:", "chosen": " Bonjour.", "rejected": " Bonsoir !"},
    {"prompt": "Q: 12345 * 6789 = ?\nA:", "chosen": " 83810205", "rejected": " 83,810,206 (approximately)"},
    {"prompt": "Complete the proverb: A stitch in time", "chosen": " saves nine.", "rejected": " is a stitch."},
    {
        "prompt": "Write a haiku about autumn.\n",
        "chosen": " Red leaves drift and fall\nquiet rivers carry them\nthe year exhales slow",
        "rejected": " Autumn is a season.",
    },
    {
        "prompt": "Q: Is café spelled with an accent?\nA:",
        "chosen": " Yes: café, naïve, and résumé all keep their accents.",
        "rejected": " No.",
    },
    {
        "prompt": "Q: How do you say 'thank you' in Japanese?\nA:",
        "chosen": " ありがとう (arigatō).",
        "rejected": " さようなら",
    },
    {"prompt": "Q: Which emoji means 'happy'?\nA:", "chosen": " 🙂 or 😄", "rejected": " 🙁"},
    {"prompt": "Q: Greek letter for the circle constant?\nA:", "chosen": " π ≈ 3.14159", "rejected": " Ω"},
    {
        "prompt": "User: what's the boiling point of water at sea level?\nAssistant:",
        "chosen": " 100 °C (212 °F).",
        "rejected": " 90 °C.",
    },
    {
        "prompt": 'def add(a, b):\n    """Return the sum."""\n#',
        "chosen": " return a + b",
        "rejected": " return a - b  # wrong",
    },
    {"prompt": "Q: List three primes.\nA:", "chosen": " 2, 3, 5.\n", "rejected": " 1, 4, 9. "},
    {
        "prompt": "Summarize: The meeting was moved from Monday to Wednesday because the room was booked.\nSummary:",
        "chosen": " The meeting moved to Wednesday; the room was taken on Monday.",
        "rejected": " There was a meeting.",
    },
    {"prompt": "¿Cuál es la capital de España?\nRespuesta:", "chosen": " Madrid.", "rejected": " Barcelona."},
    {"prompt": "Q: Arabic for 'peace'?\nA:", "chosen": " سلام", "rejected": " مرحبا"},
    {
        "prompt": "Rate the movie (1-10):",
        "chosen": ' 8/10 -- great pacing, "memorable" score.',
        "rejected": " 10/10!!!",
    },
]

SYSTEM = "You are a terse assistant. Answer in one sentence."
CHAT_ROWS = [
    # single user turn, no system message (the template inserts its default system prompt)
    {"prompt": [user("What is 2 + 2?")], "chosen": [assistant("2 + 2 = 4.")], "rejected": [assistant("5.")]},
    {
        "prompt": [user("Name a prime number greater than 100.")],
        "chosen": [assistant("101 is prime.")],
        "rejected": [assistant("100 is prime.")],
    },
    {
        "prompt": [user("Say 'thank you' in Japanese.")],
        "chosen": [assistant("ありがとうございます。")],
        "rejected": [assistant("こんにちは")],
    },
    {
        "prompt": [user("Give me an emoji for rain 🌧?")],
        "chosen": [assistant("☔ is a good one.")],
        "rejected": [assistant("🔥")],
    },
    {
        "prompt": [user("Write a Python one-liner that sums a list.")],
        "chosen": [assistant("```python\ntotal = sum(xs)\n```")],
        "rejected": [assistant("Use a for loop.")],
    },
    {
        "prompt": [user("Reply with a leading space.")],
        "chosen": [assistant(" Sure, here it is.")],
        "rejected": [assistant("No.")],
    },
    {
        "prompt": [user("Two lines please.")],
        "chosen": [assistant("Line one.\n\nLine two.")],
        "rejected": [assistant("\nOnly one line.")],
    },
    # system message + single user turn
    {
        "prompt": [system(SYSTEM), user("Capital of Italy?")],
        "chosen": [assistant("Rome.")],
        "rejected": [assistant("Milan, which is also the largest city.")],
    },
    {
        "prompt": [system("Réponds en français."), user("What colour is the sky?")],
        "chosen": [assistant("Le ciel est bleu.")],
        "rejected": [assistant("The sky is blue.")],
    },
    {
        "prompt": [system(""), user("Empty system prompt; count to three.")],
        "chosen": [assistant("1, 2, 3.")],
        "rejected": [assistant("1, 2.")],
    },
    # multi-turn histories, no system message
    {
        "prompt": [user("Name a planet."), assistant("Mars."), user("And the capital of Japan?")],
        "chosen": [assistant("Tokyo.")],
        "rejected": [assistant("Osaka.")],
    },
    {
        "prompt": [
            user("Let x = 3."),
            assistant("OK, x = 3."),
            user("Let y = x * 7."),
            assistant("y = 21."),
            user("What is x + y?"),
        ],
        "chosen": [assistant("x + y = 24.")],
        "rejected": [assistant("x + y = 10.")],
    },
    # multi-turn histories with a system message
    {
        "prompt": [
            system(SYSTEM),
            user("Who wrote Hamlet?"),
            assistant("William Shakespeare."),
            user("When, roughly?"),
        ],
        "chosen": [assistant("Around 1600.")],
        "rejected": [assistant("In 1066.")],
    },
    {
        "prompt": [
            system("Always answer with a number."),
            user("How many legs does a spider have?"),
            assistant("8"),
            user("And an insect?"),
            assistant("6"),
            user("And a snake?"),
        ],
        "chosen": [assistant("0")],
        "rejected": [assistant("Snakes have no legs at all, so none.")],
    },
    # a tool turn in the history, and a completion that spans several messages
    {
        "prompt": [user("What's the weather in Oslo?"), assistant("Let me check."), tool('{"temp_c": -3}')],
        "chosen": [assistant("It is -3 °C in Oslo.")],
        "rejected": [assistant("It is sunny and 30 °C.")],
    },
    {
        "prompt": [user("Look up 17 * 23.")],
        "chosen": [assistant("Calling the calculator."), tool("391"), assistant("17 * 23 = 391.")],
        "rejected": [assistant("17 * 23 = 381.")],
    },
]

HISTORY = [user("Hi!"), assistant("Hello! How can I help?"), user("What's 10% of 250?")]
IMPLICIT_ROWS = [
    {
        "chosen": [user("What color is the sky?"), assistant("It is blue.")],
        "rejected": [user("What color is the sky?"), assistant("It is green.")],
    },
    {
        "chosen": [user("Spell 'naïve'."), assistant("n-a-ï-v-e")],
        "rejected": [user("Spell 'naïve'."), assistant("n-a-i-v-e, without the diaeresis")],
    },
    {"chosen": [*HISTORY, assistant("25.")], "rejected": [*HISTORY, assistant("2.5")]},
    {
        "chosen": [system(SYSTEM), user("Largest ocean?"), assistant("The Pacific.")],
        "rejected": [system(SYSTEM), user("Largest ocean?"), assistant("The Atlantic.")],
    },
    {
        "chosen": [
            system("Use metric units."),
            user("How tall is Everest?"),
            assistant("About 8,849 m."),
            user("In kilometres?"),
            assistant("About 8.85 km."),
        ],
        "rejected": [
            system("Use metric units."),
            user("How tall is Everest?"),
            assistant("About 8,849 m."),
            user("In kilometres?"),
            assistant("29,032 feet."),
        ],
    },
    {
        "chosen": [user("Translate 'cat' into German, then into Korean."), assistant("Katze; 고양이")],
        "rejected": [user("Translate 'cat' into German, then into Korean."), assistant("Hund; 개")],
    },
    {
        "chosen": [user("Quote something."), assistant('"To be, or not to be" -- that is the question.')],
        "rejected": [user("Quote something."), assistant("No quotes today!")],
    },
]

# Anthropic HH-RLHF's shape: full texts only; TRL's extract_prompt takes their shared text (less a trailing space) as
# the prompt. The answers here differ from their first word, so that prefix ends at the final "\n\nAssistant:".
HH = "\n\nHuman: {}\n\nAssistant:"
HH_ROWS = [
    {
        "chosen": HH.format("What color is the sky?") + " Blue, on a clear day.",
        "rejected": HH.format("What color is the sky?") + " Green.",
    },
    {
        "chosen": HH.format("Hi!") + " Hello! How can I help?" + HH.format("What's 10% of 250?") + " 25.",
        "rejected": HH.format("Hi!") + " Hello! How can I help?" + HH.format("What's 10% of 250?") + " It's 2.5",
    },
    {
        "chosen": HH.format("Can you help me cheat on a test?") + " I can't help with that.",
        "rejected": HH.format("Can you help me cheat on a test?") + " Sure, here's how.",
    },
    {"chosen": HH.format("Spell 'naïve'.") + "n-a-ï-v-e", "rejected": HH.format("Spell 'naïve'.") + " n a i v e"},
    {
        "chosen": HH.format("Translate 'cat' into Korean.") + " 고양이",
        "rejected": HH.format("Translate 'cat' into Korean.") + " 개",
    },
]
# HH answers that open alike: TRL's character prefix runs into them, ending the prompt mid-answer.
HH_ALIKE_ROW = {
    "chosen": HH.format("Is it safe?") + " I think so.",
    "rejected": HH.format("Is it safe?") + " I don't know.",
}

# Plain text whose join merges under BPE: " is" + "n't" -> " isn" "'t", and "hello" + "world" -> "hel" "low" "orld".
MERGE_ROWS = [
    {"prompt": "The answer is", "chosen": "n't obvious", "rejected": " obvious"},
    {"prompt": "hello", "chosen": "world", "rejected": " there"},
]
# A conversation whose completion starts with two spaces: "assistant\n" + "  Two" tokenizes as "\n " + " Two".
CHAT_MERGE_ROW = {
    "prompt": [user("Indent your answer.")],
    "chosen": [assistant("  Two spaces.")],
    "rejected": [assistant("None.")],
}

FORMATS = {"text": TEXT_ROWS, "chat_explicit": CHAT_ROWS, "chat_implicit": IMPLICIT_ROWS, "text_implicit": HH_ROWS}


# -- fixtures --------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer_dir():
    from dpo_train.model.bundled import materialize_smollm2

    return materialize_smollm2()


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    """Our own instance, untouched by the trainer (which may set a pad token on the one it is given)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def ours(tokenizer):
    """Our ids for every row, encoded in one batch per format (as a build would)."""
    encoder = PairEncoder(tokenizer, TokenizeOptions(max_length=None, overlength="reject", append_eos=True))
    rows = {**FORMATS, "text_merge": MERGE_ROWS, "chat_merge": [CHAT_MERGE_ROW], "text_alike": [HH_ALIKE_ROW]}
    return {name: encoder.encode_many([normalize_row(r) for r in group]) for name, group in rows.items()}


def trl_prepare(tokenizer_dir, sets: dict[str, list[dict]], output_dir) -> dict[str, list[dict]]:
    """TRL 1.16's own preparation (DPOTrainer's tokenization) of each named list of rows, as lists of rows
    ({'prompt_ids', 'chosen_ids', 'rejected_ids', ...}); the first set is the train dataset, the rest eval."""
    import datasets
    import torch
    import transformers
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    from tests.tiny import tiny_llama_model

    def tiny_model():
        return tiny_llama_model(hidden_size=64, intermediate_size=128)

    (first, train_rows), *rest = sets.items()
    progress_was_enabled = datasets.is_progress_bar_enabled()
    verbosity = transformers.logging.get_verbosity()
    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # deprecation chatter from TrainingArguments / TRL, not under test
            torch.manual_seed(0)
            args = DPOConfig(output_dir=str(output_dir), report_to=[], max_length=None, bf16=False, use_cpu=True)
            trainer = DPOTrainer(
                model=tiny_model(),
                ref_model=tiny_model(),  # passed explicitly: an in-memory model has no path to load a reference from
                args=args,
                processing_class=AutoTokenizer.from_pretrained(tokenizer_dir),
                train_dataset=datasets.Dataset.from_list(train_rows),
                eval_dataset={name: datasets.Dataset.from_list(rows) for name, rows in rest},
            )
    finally:
        if progress_was_enabled:
            datasets.enable_progress_bars()
        transformers.logging.set_verbosity(verbosity)
    prepared = {first: trainer.train_dataset.to_list()}
    prepared.update({name: ds.to_list() for name, ds in trainer.eval_dataset.items()})
    return prepared


@pytest.fixture(scope="module")
def trl_prepared(tokenizer_dir, tmp_path_factory):
    """TRL's prepared datasets as lists of rows: {format name: [{'prompt_ids', 'chosen_ids', 'rejected_ids', ...}]}."""
    sets = {
        "text": TEXT_ROWS,
        "chat_explicit": CHAT_ROWS,
        "chat_implicit": IMPLICIT_ROWS,
        "text_merge": MERGE_ROWS,
        "chat_merge": [CHAT_MERGE_ROW],
        "text_implicit": HH_ROWS,
        "text_alike": [HH_ALIKE_ROW],
    }
    return trl_prepare(tokenizer_dir, sets, tmp_path_factory.mktemp("trl"))


# -- parity ----------------------------------------------------------------------------------------


def describe(tokenizer, label: str, ids: list[int]) -> str:
    return f"  {label}: {ids}\n  {' ' * len(label)}  = {tokenizer.decode(ids)!r}"


def test_trl_keeps_every_row(trl_prepared, ours):
    """No row is filtered by TRL (max_length=None) and we accept every parity row, so rows line up by index."""
    for name, rows in FORMATS.items():
        assert len(trl_prepared[name]) == len(rows), name
        rejected = [(i, r.reason, r.message) for i, r in enumerate(ours[name]) if isinstance(r, RowReject)]
        assert not rejected, f"{name}: we reject rows TRL accepts: {rejected}"
        assert all({"prompt_ids", "chosen_ids", "rejected_ids"} <= row.keys() for row in trl_prepared[name])


@pytest.mark.parametrize(
    ("name", "index"),
    [(name, i) for name, rows in FORMATS.items() for i in range(len(rows))],
    ids=[f"{name}-{i}" for name, rows in FORMATS.items() for i in range(len(rows))],
)
def test_ids_equal_trl(name, index, ours, trl_prepared, tokenizer):
    mine, theirs = ours[name][index], trl_prepared[name][index]
    assert isinstance(mine, EncodedPair), f"we reject {FORMATS[name][index]!r}: {mine}"
    report = []
    for part in ("prompt", "chosen", "rejected"):
        a, b = getattr(mine, part), theirs[f"{part}_ids"]
        if a != b:
            report.append(f"{part} differs\n{describe(tokenizer, 'ours', a)}\n{describe(tokenizer, 'trl ', b)}")
    assert not report, f"row {FORMATS[name][index]!r}\n" + "\n".join(report)


def test_completion_endings_match_trl_conventions(ours, tokenizer):
    """Plain text ends each completion with the EOS id (TRL appends the EOS text, which encodes to that id);
    conversations end with the template's own end of turn and get no extra EOS, in TRL and here."""
    eos = tokenizer.eos_token_id
    for pair in ours["text"] + ours["text_implicit"]:
        assert pair.chosen[-1] == eos and pair.rejected[-1] == eos
        assert eos not in pair.chosen[:-1] and eos not in pair.rejected[:-1]
    end_of_turn = tokenizer("<|im_end|>\n")["input_ids"]
    for name in ("chat_explicit", "chat_implicit"):
        for pair in ours[name]:
            assert pair.chosen[-2:] == end_of_turn and pair.rejected[-2:] == end_of_turn


# -- documented differences ------------------------------------------------------------------------


def test_text_join_that_merges_under_bpe_truncates_trls_prompt_but_not_ours(ours, trl_prepared, tokenizer):
    """TRL tokenizes prompt + completion as one string and cuts the prompt back to where the ids diverge; we encode
    prompt and completion separately, so the prompt is exactly tokenizer(prompt) and each completion is
    tokenizer(completion) + EOS. Both describe the same text; only the token boundary differs."""

    def tok(text, **kw):
        return tokenizer(text, **kw)["input_ids"]

    eos = tokenizer.eos_token_id
    mine = ours["text_merge"]
    theirs = trl_prepared["text_merge"]
    for row, pair in zip(MERGE_ROWS, mine):
        assert isinstance(pair, EncodedPair)
        assert pair.prompt == tok(row["prompt"])
        assert pair.chosen == tok(row["chosen"], add_special_tokens=False) + [eos]
        assert pair.rejected == tok(row["rejected"], add_special_tokens=False) + [eos]

    # "The answer is" + "n't obvious": " is" + "n't" becomes " isn" + "'t", so TRL's prompt loses " is", which moves
    # into the front of both of TRL's completions.
    answer, trl_answer = mine[0], theirs[0]
    assert tokenizer.convert_ids_to_tokens(answer.prompt) == ["The", "Ġanswer", "Ġis"]
    assert trl_answer["prompt_ids"] == answer.prompt[:2]
    assert tokenizer.decode(trl_answer["prompt_ids"]) == "The answer"
    assert tokenizer.convert_ids_to_tokens(trl_answer["chosen_ids"]) == ["Ġisn", "'t", "Ġobvious", "<|im_end|>"]
    assert trl_answer["rejected_ids"] == answer.prompt[2:] + answer.rejected
    assert tokenizer.decode(trl_answer["prompt_ids"] + trl_answer["chosen_ids"]) == tokenizer.decode(
        answer.prompt + answer.chosen
    )
    assert trl_answer["prompt_ids"] + trl_answer["chosen_ids"] != answer.prompt + answer.chosen

    # "hello" + "world": "helloworld" shares no first token with "hello", so TRL's prompt is empty and the whole
    # prompt text is trained on as part of both completions.
    hello, trl_hello = mine[1], theirs[1]
    assert tokenizer.convert_ids_to_tokens(hello.prompt) == ["hello"]
    assert trl_hello["prompt_ids"] == []
    assert tokenizer.convert_ids_to_tokens(trl_hello["chosen_ids"]) == ["hel", "low", "orld", "<|im_end|>"]
    assert trl_hello["rejected_ids"] == hello.prompt + hello.rejected
    assert tokenizer.decode(trl_hello["chosen_ids"]) == "helloworld<|im_end|>"


def test_chat_completion_that_merges_with_the_generation_prompt_is_rejected_here_and_truncated_by_trl(
    ours, trl_prepared, tokenizer
):
    """A completion starting with two spaces merges with the newline after "<|im_start|>assistant": TRL keeps the
    row with the prompt cut before that newline; we reject the row rather than train on a prompt the model never
    sees at inference."""
    (mine,) = ours["chat_merge"]
    (theirs,) = trl_prepared["chat_merge"]
    assert isinstance(mine, RowReject) and mine.reason == "template_not_prefix_stable"
    full_prompt = tokenizer.apply_chat_template(CHAT_MERGE_ROW["prompt"], add_generation_prompt=True, return_dict=False)
    assert tokenizer.decode(full_prompt).endswith("<|im_start|>assistant\n")
    assert theirs["prompt_ids"] == full_prompt[:-1]
    assert tokenizer.decode(theirs["prompt_ids"]).endswith("<|im_start|>assistant")
    assert tokenizer.convert_ids_to_tokens(theirs["chosen_ids"])[:2] == ["ĊĠ", "ĠTwo"]
    assert tokenizer.decode(theirs["rejected_ids"]) == "\nNone.<|im_end|>\n"


def test_hh_texts_split_where_trls_extract_prompt_splits_them(tokenizer):
    """Independent of the trainer: our implicit text prompt is `trl.data_utils.extract_prompt`'s, character for
    character, on every HH row whose answers differ from their first word."""
    from trl.data_utils import extract_prompt

    for row in HH_ROWS:
        pair = normalize_row(row)
        assert (pair.prompt, pair.chosen, pair.rejected) == tuple(extract_prompt(row).values())
        assert pair.prompt.endswith("\n\nAssistant:")


def test_hh_answers_that_open_alike_split_at_the_turn_here_and_mid_answer_in_trl(ours, trl_prepared, tokenizer):
    """Answers " I think so." and " I don't know.": TRL's prompt runs on to "...Assistant: I" (its shared
    characters, less the trailing space) and trains only from there; ours stops at the turn, so " I" opens both
    completions (the same token in the same context, which cancels from the pair's log-ratio margin). Same text,
    other boundary."""
    (mine,) = ours["text_alike"]
    (theirs,) = trl_prepared["text_alike"]
    prompt = HH.format("Is it safe?")
    assert mine.prompt == tokenizer(prompt)["input_ids"]
    assert tokenizer.decode(theirs["prompt_ids"]) == prompt + " I"
    assert theirs["prompt_ids"] == mine.prompt + mine.chosen[:1] == mine.prompt + mine.rejected[:1]
    assert (theirs["chosen_ids"], theirs["rejected_ids"]) == (mine.chosen[1:], mine.rejected[1:])
