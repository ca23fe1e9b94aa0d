"""Tokenizer attestation v2: stable under relocation and call state, different under any change of behaviour."""

from __future__ import annotations

import json
import shutil

import pytest
from transformers import AutoTokenizer

from dpo_state.attestation import tokenizer_attestation, tokenizer_fingerprint


@pytest.fixture
def tokenizer_copy(smollm2_dir, tmp_path):
    """The tokenizer files alone, copied to a fresh directory under another name."""
    d = tmp_path / "somewhere" / "else"
    d.mkdir(parents=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / name, d / name)
    return d


def test_a_copied_tokenizer_attests_the_same(tokenizer, tokenizer_copy):
    moved = AutoTokenizer.from_pretrained(tokenizer_copy)
    assert tokenizer_fingerprint(moved) == tokenizer_fingerprint(tokenizer)
    assert tokenizer_fingerprint(tokenizer).startswith("v2:")


def test_a_resaved_tokenizer_attests_the_same(tokenizer, tmp_path):
    # save_pretrained rewrites tokenizer_config.json with load-time fields: the files differ, the identity not.
    tokenizer.save_pretrained(tmp_path)
    assert tokenizer_fingerprint(AutoTokenizer.from_pretrained(tmp_path)) == tokenizer_fingerprint(tokenizer)


def test_truncation_and_padding_calls_do_not_change_the_fingerprint(tokenizer_copy):
    tok = AutoTokenizer.from_pretrained(tokenizer_copy)
    before = tokenizer_attestation(tok)["fingerprint"]
    fresh = AutoTokenizer.from_pretrained(tokenizer_copy)
    fresh("some text", truncation=True, max_length=4, padding="max_length")
    assert tokenizer_fingerprint(fresh) == before


def test_an_added_token_changes_the_fingerprint(tokenizer_copy):
    tok = AutoTokenizer.from_pretrained(tokenizer_copy)
    before = tokenizer_attestation(tok)
    tok.add_tokens(["<new_tool_token>"])
    after = tokenizer_attestation(tok)  # same object: the cache must notice
    assert after["fingerprint"] != before["fingerprint"]
    assert after["components"]["added_tokens"] != before["components"]["added_tokens"]


def test_an_edited_chat_template_changes_the_fingerprint(tokenizer_copy):
    before = tokenizer_attestation(AutoTokenizer.from_pretrained(tokenizer_copy))
    path = tokenizer_copy / "chat_template.jinja"
    path.write_text(path.read_text().replace("You are a helpful AI assistant", "You are an AI assistant"))
    after = tokenizer_attestation(AutoTokenizer.from_pretrained(tokenizer_copy))
    assert after["fingerprint"] != before["fingerprint"]
    assert [k for k in before["components"] if before["components"][k] != after["components"][k]] == ["chat_template"]


def test_a_changed_normalizer_changes_the_fingerprint(tokenizer_copy):
    before = tokenizer_attestation(AutoTokenizer.from_pretrained(tokenizer_copy))
    path = tokenizer_copy / "tokenizer.json"
    spec = json.loads(path.read_text())
    spec["normalizer"] = {"type": "NFKC"}
    path.write_text(json.dumps(spec))
    after = tokenizer_attestation(AutoTokenizer.from_pretrained(tokenizer_copy))
    assert after["fingerprint"] != before["fingerprint"]
    assert after["components"]["backend"] != before["components"]["backend"]


def test_the_attestation_is_cached_per_tokenizer_object(tokenizer):
    assert tokenizer_attestation(tokenizer) is tokenizer_attestation(tokenizer)
