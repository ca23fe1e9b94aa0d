"""The build's tokenizer load: AutoTokenizer's own choice, read without transformers where the light reader
reproduces it (tests/data/test_light_tokenizer.py holds the two equal) and without torch where it is the generic
class."""

from __future__ import annotations

import json

import pytest

from dpo_data.tokenizer import load_tokenizer
from dpo_data.tokenizer.generic import PLAIN_MODEL_TYPES, takes_generic_class
from dpo_data.tokenizer.light import LightTokenizer
from dpo_state.attestation import tokenizer_attestation
from tests.data.test_tool_calls import TOOL_TEMPLATE, with_template


def test_no_plain_model_type_is_one_transformers_redirects():
    """AutoTokenizer loads these model types with a class of their own whatever tokenizer_config.json names:
    the torch-free load must never take one of them for the generic class."""
    from transformers.models.auto.tokenization_auto import MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS

    assert not PLAIN_MODEL_TYPES & MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS
    assert {"qwen2", "phi3"} <= MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS  # why those two are not listed


@pytest.mark.parametrize(
    ("tokenizer_config", "model_config", "generic"),
    [
        ({"tokenizer_class": "TokenizersBackend"}, {"model_type": "llama"}, True),
        ({"tokenizer_class": "PreTrainedTokenizerFast"}, None, True),
        ({"tokenizer_class": "TokenizersBackend"}, {"model_type": "qwen2"}, False),
        ({"tokenizer_class": "Qwen2Tokenizer"}, {"model_type": "qwen3"}, False),
        ({"tokenizer_class": "TokenizersBackend", "auto_map": {}}, {"model_type": "llama"}, False),
        ({"tokenizer_class": "TokenizersBackend"}, {"model_type": "llama", "auto_map": {}}, False),
        ({"tokenizer_class": "TokenizersBackend"}, {"model_type": "some_new_model"}, False),
        (None, {"model_type": "llama"}, False),
    ],
)
def test_only_the_generic_class_of_a_plain_model_skips_autotokenizer(tokenizer_config, model_config, generic):
    assert takes_generic_class(tokenizer_config, model_config) is generic


@pytest.mark.parametrize("copy", ["model", "tokenizer saved alone", "tool template"])
def test_the_light_load_is_autotokenizers_tokenizer(copy, smollm2_dir, tmp_path):
    """The light reader takes the model directory and tokenizers saved alone (no config.json), the tool-calling
    template's copy among them: same attestation, same ids through the chat template."""
    from transformers import AutoTokenizer

    directory = smollm2_dir
    if copy == "tokenizer saved alone":
        AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(tmp_path)
        directory = tmp_path
    elif copy == "tool template":
        directory = with_template(smollm2_dir, tmp_path, TOOL_TEMPLATE)
    assert (directory / "config.json").is_file() == (copy == "model")
    assert json.loads((directory / "tokenizer_config.json").read_text())["tokenizer_class"] == "TokenizersBackend"
    ours, theirs = load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    assert isinstance(ours, LightTokenizer)
    assert tokenizer_attestation(ours) == tokenizer_attestation(theirs)
    chat = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is 4."}]
    ids = ours.apply_chat_template(chat, tokenize=True, return_dict=False)
    assert ids == theirs.apply_chat_template(chat, tokenize=True, return_dict=False) and len(ids) > 10
