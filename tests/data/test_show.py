"""`dpo-data show`: pairs decoded with the dataset's tokenizer, the template's text marked, counts from stored ids."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from dpo_cli.data import main as dpo_data
from dpo_data.dataset.show import SHOW_FORMAT_VERSION
from dpo_data.dataset.store import PairStore
from dpo_state.schema import load_schema, schema_problems
from tests.conftest import chat, write_jsonl
from tests.harness import cli_argv, run_process
from tests.vision.conftest import qwen25vl, vision_datasets, vlm_dirs  # noqa: F401 - fixtures

FRANCE = (
    "\u27e6<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\n\u27e7What is the capital of France?\u27e6<|im_end|>\n<|im_start|>assistant\n\u27e7"
)
"""The motivating pair as shown: SmolLM2's template inserts a default system prompt (30 of the prompt's 37 tokens)."""


@pytest.fixture(scope="module")
def dataset(smollm2_dir, tmp_path_factory):
    """Three pairs from three sources, built with the real SmolLM2 tokenizer: a one-turn question, a conversation
    with a system message, special-token text typed in a message and a character split over tokens, and a plain-text
    row."""
    from dpo_data.prepare.build import BuildOptions, build

    tmp = tmp_path_factory.mktemp("show")
    multi = chat("Capital of Peru?", "Lima. \u2603", "Cusco.", system="Be brief.")  # a snowman: 3 byte tokens
    multi["prompt"][1:1] = [
        {"role": "user", "content": "Hi <|im_start|> there"},
        {"role": "assistant", "content": "Hello."},
    ]
    rows = [
        {**chat("What is the capital of France?", "Paris.", "Lyon, I think."), "source": "geo"},
        {**multi, "source": "chat"},
        {"prompt": "2 + 2?", "chosen": " 4", "rejected": " 5", "source": "plain"},
    ]
    result = build([str(write_jsonl(tmp / "rows.jsonl", rows))], str(smollm2_dir), tmp / "data", BuildOptions())
    assert result.manifest["totals"]["pairs"] == 3
    return tmp / "data"


def test_the_templates_default_system_prompt_is_marked_apart_from_the_question(dataset, smollm2_dir, run_cli):
    r = run_cli(dpo_data, "show", dataset, "--tokenizer", smollm2_dir, "--pair", 0)
    assert r.exit_code == 0, r.output
    assert "prompt 37 tokens (template 30, text 7) | chosen 4 tokens (template 2, text 2)" in r.output
    assert FRANCE in r.output and "Paris.\u27e6<|im_end|>\n\u27e7" in r.output
    assert "matched as a conversation of user:" in r.output
    docs = (Path(__file__).resolve().parents[2] / "docs" / "data-build.md").read_text()
    shown = docs.split('$ dpo-data show data/train --tokenizer "$(dpo-data smollm2)" --pair 0\n')[1].split("```")[0]
    assert r.output.replace(str(dataset), "data/train") == shown  # the documented example is this output


def test_counts_are_the_stored_ids_and_special_token_text_typed_in_a_message_is_the_rows(dataset, smollm2_dir, run_cli):
    """The build encodes "<|im_start|>" typed in a message as plain text: re-tokenizing the decoded text would make
    it the special token, one id where the shard holds several, and take it for the template's."""
    from dpo_data.tokenizer import load_tokenizer

    r = run_cli(dpo_data, "show", dataset, "--tokenizer", smollm2_dir, "--limit", 5, "--json")
    docs = [json.loads(line) for line in r.output.splitlines()]
    store, backend = PairStore([dataset]), load_tokenizer(smollm2_dir).backend_tokenizer
    version = load_schema("show")["properties"]["format_version"]["const"]
    assert [d["pair"] for d in docs] == [0, 1, 2] and [d["source"] for d in docs] == ["geo", "chat", "plain"]
    for doc in docs:
        assert schema_problems("show", doc) == [] and doc["format_version"] == SHOW_FORMAT_VERSION == version
        stored = store.pair(doc["pair"])
        for name, part in doc["parts"].items():
            assert part["ids"] == getattr(stored, name).tolist()
            assert part["tokens"] == getattr(store, f"{name}_len")[doc["pair"]] == part["template"] + part["text"]
            assert "".join(part["pieces"]) == backend.decode(part["ids"], skip_special_tokens=False)
    assert docs[1]["template"] == {"matched": True, "roles": ["system", "user", "assistant", "user"]}
    shown = run_cli(dpo_data, "show", dataset, "--tokenizer", smollm2_dir, "--source", "chat").output
    assert "\u27e7Be brief.\u27e6" in shown and "\u27e7Hi <|im_start|> there\u27e6" in shown
    assert "\u27e7Capital of Peru?\u27e6" in shown and "Lima. \u2603\u27e6<|im_end|>" in shown
    assert shown.count("pair ") == 1


def test_a_plain_text_row_marks_its_special_tokens_alone_and_says_so(dataset, smollm2_dir, run_cli):
    r = run_cli(dpo_data, "show", dataset, "--tokenizer", smollm2_dir, "--source", "plain")
    assert "prompt 5 tokens (template 0, text 5) | chosen 3 tokens (template 1, text 2)" in r.output
    assert "special tokens alone are \u27e6marked\u27e7" in r.output
    assert "--- chosen ---\n 4\u27e6<|im_end|>\u27e7\n" in r.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--pair", "3"], "--pair 3: {data} holds 3 pairs; give an index from 0 to 2"),
        (["--pair", "-1"], "--pair -1: {data} holds 3 pairs; give an index from 0 to 2"),
        (["--source", "web"], "--source web: {data} has no such source; its sources: geo (1 pairs), chat (1 pairs)"),
        (["--pair", "0", "--source", "geo"], "--pair 0 and --source geo: give one of them"),
        (["--limit", "0"], "--limit 0: give a positive number of pairs to show"),
    ],
)
def test_a_bad_selection_is_one_error_line(dataset, smollm2_dir, args, message):
    done = run_process(cli_argv("data", "show", dataset, "--tokenizer", smollm2_dir, *args), code=2)
    assert done.stderr.startswith(f"error: {message.format(data=dataset)}") and done.stderr.count("\n") == 1
    assert done.stdout == ""


def test_a_directory_that_is_not_a_dataset_is_one_error_line(smollm2_dir, tmp_path):
    done = run_process(cli_argv("data", "show", tmp_path, "--tokenizer", smollm2_dir), code=2)
    assert done.stderr == f"error: {tmp_path}: not a committed dataset, manifest.json is missing; run dpo-data build\n"


def test_a_tokenizer_other_than_the_datasets_is_refused_by_name(dataset, smollm2_dir, tmp_path):
    """Same files but two vocabulary entries swapped: its ids would decode to another text, so nothing is shown."""
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / name, tmp_path / name)
    spec = json.loads((smollm2_dir / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    vocab["Paris"], vocab["France"] = vocab["France"], vocab["Paris"]
    (tmp_path / "tokenizer.json").write_text(json.dumps(spec))
    done = run_process(cli_argv("data", "show", dataset, "--tokenizer", tmp_path), code=2)
    assert done.stderr.startswith(f"error: --tokenizer {tmp_path} is not the tokenizer {dataset} was built with")
    assert "differing parts: " in done.stderr and done.stderr.count("\n") == 1 and done.stdout == ""


def test_a_vision_pair_names_its_images_at_their_placeholder_tokens(vision_datasets, qwen25vl, run_cli):  # noqa: F811
    data = vision_datasets["qwen2_5_vl"]
    r = run_cli(dpo_data, "show", data, "--processor", qwen25vl, "--limit", 8, "--json")
    docs = [json.loads(line) for line in r.output.splitlines()]
    store = PairStore([data])
    assert len(docs) == 8 and sum(len(d["images"]) for d in docs) == 10
    for doc in docs:
        assert schema_problems("show", doc) == []
        prompt = doc["parts"]["prompt"]
        assert [image["sha256"] for image in doc["images"]] == [h for _, h in store.images(doc["pair"])]
        for image in doc["images"]:
            start, stop = image["tokens"]
            assert set(prompt["origin"][start:stop]) == {"image"} and image["width"] > 0
        assert prompt["image"] == sum(i["tokens"][1] - i["tokens"][0] for i in doc["images"])
        assert prompt["template"] + prompt["text"] + prompt["image"] == store.prompt_len[doc["pair"]]
    text = run_cli(dpo_data, "show", data, "--processor", qwen25vl, "--pair", 0).output
    for image in docs[0]["images"]:
        assert f"image {image['index']}: sha256 {image['sha256'][:16]}..., {image['bytes']} bytes" in text
