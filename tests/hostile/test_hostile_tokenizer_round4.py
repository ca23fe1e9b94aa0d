"""Hostile round 4 (issue 55), tokenizers: a malformed tokenizer directory is one named error in every command that
loads one, and a tokenizer mismatch's advice never trains a model on ids that name other tokens to it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.conftest import chat, write_jsonl
from tests.harness import data_cli, tiny_config, train_here, write_yaml
from tests.tiny import tiny_llama_model

FILES = ("tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja")
NESTED = "[" * 100_000 + "]" * 100_000
"""Deeper than any JSON reader's stack: Python's json raised RecursionError through both loaders."""


def _copy(smollm2_dir: Path, out: Path) -> Path:
    out.mkdir(parents=True)
    for name in FILES:
        shutil.copy(smollm2_dir / name, out / name)
    return out


def _edit(directory: Path, name: str, change) -> None:
    path = directory / name
    document = json.loads(path.read_text())
    change(document)
    path.write_text(json.dumps(document))


def _nested(name: str):
    def mutate(directory: Path) -> None:
        path = directory / name
        text = path.read_text() if path.exists() else "{}"
        path.write_text(text.rstrip().removesuffix("}") + (", " if text.strip() != "{}" else "") + f'"x": {NESTED}}}')

    return mutate


def _config(**fields):
    return lambda directory: _edit(directory, "tokenizer_config.json", lambda c: c.update(fields))


def _other_model_type(directory: Path) -> None:
    _edit(directory, "tokenizer.json", lambda spec: spec["model"].update(type="WordPiece"))


def _added_content_in_tokenizer_json(directory: Path) -> None:
    _edit(directory, "tokenizer.json", lambda spec: spec["added_tokens"][0].update(content=5))


MALFORMED = {
    "nested tokenizer.json": (_nested("tokenizer.json"), "tokenizer.json: JSON nested more than 1024 levels"),
    "nested tokenizer_config.json": (_nested("tokenizer_config.json"), "tokenizer_config.json: JSON nested"),
    "nested config.json": (_nested("config.json"), "config.json: JSON nested more than 1024 levels"),
    "nested special_tokens_map.json": (_nested("special_tokens_map.json"), "special_tokens_map.json: JSON nested"),
    "eos_token a number": (_config(eos_token=7), "tokenizer_config.json: eos_token is 7 (a number)"),
    "eos_token a list": (_config(eos_token=["<|im_end|>"]), 'eos_token is ["<|im_end|>"] (a list)'),
    "bos_token a boolean": (_config(bos_token=True), "bos_token is true (a boolean)"),
    "pad_token an object with a number": (_config(pad_token={"content": 5}), 'pad_token is {"content": 5}'),
    "an added token whose content is a number": (
        _config(added_tokens_decoder={"0": {"content": 5, "special": True}}),
        "added_tokens_decoder['0'] is {\"content\": 5",
    ),
    "an added token of tokenizer.json whose content is a number": (
        _added_content_in_tokenizer_json,
        "tokenizer.json: the tokenizers library cannot read it",
    ),
    'split_special_tokens "true"': (_config(split_special_tokens="true"), 'split_special_tokens is "true" (a string)'),
    "an array for added_tokens_decoder": (_config(added_tokens_decoder=[]), "added_tokens_decoder is [] (a list)"),
    "an array for tokenizer_config.json": (
        lambda d: (d / "tokenizer_config.json").write_text("[]"),
        "tokenizer_config.json: is a list, not a JSON object",
    ),
    "a tokenizer.json of another model type": (_other_model_type, "cannot read it as a WordPiece model"),
}


@pytest.fixture(scope="module")
def malformed(smollm2_dir, tmp_path_factory) -> dict[str, Path]:
    """Each case's directory: a copy of SmolLM2's tokenizer files with one file changed."""
    root = tmp_path_factory.mktemp("malformed")
    directories = {}
    for i, (name, (mutate, _)) in enumerate(MALFORMED.items()):
        directories[name] = _copy(smollm2_dir, root / f"case{i}")
        mutate(directories[name])
    return directories


@pytest.mark.parametrize("case", list(MALFORMED))
@pytest.mark.parametrize("savable", [False, True], ids=["build-verify", "train"])
def test_a_malformed_tokenizer_directory_is_one_named_error(malformed, case, savable):
    """Before, each raised RecursionError, TypeError, AttributeError or the tokenizers library's bare Exception
    through `dpo-data build`, `verify` and `dpo-train` (a traceback); now the loader all three use names the file
    and field. `savable` is dpo-train's load (transformers' own object, which the export saves)."""
    from dpo_data.tokenizer import load_tokenizer

    with pytest.raises(ValueError) as refused:
        load_tokenizer(malformed[case], savable=savable)
    assert MALFORMED[case][1] in str(refused.value)


def test_the_build_cli_names_a_malformed_tokenizer(malformed, tmp_path):
    """In the CLI's own process: one error line, no traceback, nothing committed."""
    rows = write_jsonl(tmp_path / "rows.jsonl", [chat("Hi", "Yes.", "No.")])
    for case in ("nested tokenizer_config.json", "eos_token a list", "a tokenizer.json of another model type"):
        directory = malformed[case]
        proc = data_cli("build", rows, "--tokenizer", directory, "--out", tmp_path / "out", code=2)
        assert f"error: --tokenizer {directory}: cannot load a tokenizer (" in proc.stderr
        assert MALFORMED[case][1] in proc.stderr and proc.stderr.count("\n") == 2  # "build ..." and the error
        assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_verify_and_train_name_a_malformed_tokenizer(malformed, small_dataset, tmp_path, run_cli):
    directory = malformed['split_special_tokens "true"']
    proc = data_cli("verify", small_dataset, "--tokenizer", directory, code=1)
    assert f"--tokenizer {directory}: cannot load a tokenizer (tokenizer_config.json: split_special_tokens" in (
        proc.stdout + proc.stderr
    )
    assert "Traceback" not in proc.stderr
    config = write_yaml(tmp_path / "c.yaml", tiny_config(small_dataset, directory, tmp_path / "run", max_steps=1))
    result = train_here(run_cli, config, code=2)
    assert f"model.tokenizer {directory}: cannot load a tokenizer (tokenizer_config.json: split_special_tokens" in (
        result.stderr
    )


def test_a_whole_tokenizer_json_of_another_model_type_builds(smollm2_dir, tmp_path, run_cli):
    """A WordPiece tokenizer.json that is whole is a legal tokenizer: the light reader and AutoTokenizer agree on
    it, and it builds."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer

    from dpo_data.tokenizer import load_tokenizer
    from dpo_state.attestation import tokenizer_fingerprint
    from tests.harness import data_here

    directory = _copy(smollm2_dir, tmp_path / "wordpiece")
    vocabulary = {"[UNK]": 0, "<|endoftext|>": 1, "<|im_start|>": 2, "<|im_end|>": 3, "Hi": 4, "Yes": 5, ".": 6}
    backend = Tokenizer(models.WordPiece(vocabulary, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    backend.save(str(directory / "tokenizer.json"))
    light, auto = load_tokenizer(directory), AutoTokenizer.from_pretrained(directory)
    assert tokenizer_fingerprint(light) == tokenizer_fingerprint(auto)
    rows = write_jsonl(tmp_path / "rows.jsonl", [chat("Hi", "Yes.", "No.")])
    data_here(run_cli, "build", rows, "--tokenizer", directory, "--out", tmp_path / "out")
    assert (tmp_path / "out" / "manifest.json").is_file()


# -- the mismatch's advice: what the data's ids mean to the model -----------------------------------------------


def _model(directory: Path, vocab_size: int) -> Path:
    """A tiny random Llama of `vocab_size` embedding rows saved at `directory` (no tokenizer)."""
    tiny_llama_model(vocab_size=vocab_size).save_pretrained(directory)
    return directory


def _small_tokenizer(directory: Path) -> None:
    """A whole tokenizer of 8 tokens, saved beside a model: another vocabulary than SmolLM2's."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "</s>", "What", "is", "plus", "It", "?"]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")
    fast.save_pretrained(directory)


def _largest(dataset: Path) -> int:
    return json.loads((dataset / "manifest.json").read_text())["totals"]["max_token_id"]


def _run(dataset: Path, out: Path, **model) -> Path:
    config = tiny_config(dataset, Path("unused"), out / "run", max_steps=1)
    config["model"] = model
    return write_yaml(out / "c.yaml", config)


def test_a_model_of_another_vocabulary_is_told_to_rebuild_not_to_point_model_tokenizer(
    small_dataset, tmp_path, run_cli
):
    """model.path's own tokenizer (8 tokens, a model of 1000 rows) is not the data's (SmolLM2's): pointing
    model.tokenizer at SmolLM2's, the old first fix, would train this model on ids that name other tokens (or none).
    The advice checks the vocabularies and gives the rebuild command instead."""
    model = _model(tmp_path / "model", 1000)
    _small_tokenizer(model)
    result = train_here(run_cli, _run(small_dataset, tmp_path, path=str(model)), code=2)
    fix = result.stderr.split("fix: ", 1)[1]
    assert "point model.tokenizer" not in result.stderr
    inputs = small_dataset.parent / "pairs.jsonl"
    assert fix.startswith(
        f"rebuild them with the model's tokenizer: `dpo-data build {inputs} --tokenizer {model} --out "
        f"{small_dataset}-rebuilt`"
    )
    assert f"differs in what its ids mean (49152 tokens, the data's ids up to {_largest(small_dataset)}" in fix
    assert f"the run's: 8 tokens; model.path {model} embeds 1000 ids" in fix


def test_a_model_smaller_than_the_data_is_refused_with_the_rebuild_command(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    """model.tokenizer is the data's, but model.path embeds 1000 ids and the data reaches past 30000: refused by
    name before the model loads, with the command that rebuilds the data with the model's own tokenizer."""
    model = _model(tmp_path / "model", 1000)
    _small_tokenizer(model)
    config = _run(small_dataset, tmp_path, path=str(model), tokenizer=str(smollm2_dir))
    result = train_here(run_cli, config, code=2)
    assert "but the model embeds only 1000 ids (0 to 999)" in result.stderr
    assert "fix: rebuild the data with the model's tokenizer: `dpo-data build " in result.stderr
    assert f"--tokenizer {model} --out {small_dataset}-rebuilt`" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_model_tokenizer_whose_eos_is_another_id_than_the_models_own_is_refused(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    """model.path's own tokenizer ends a turn with <|endoftext|> (id 0); model.tokenizer, the data's, with
    <|im_end|> (id 2). Before, this trained (exit 0): the model learnt another token as its end."""
    model = _model(tmp_path / "model", 49152)
    _copy(smollm2_dir, tmp_path / "own")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tmp_path / "own" / name, model / name)
    _edit(model, "tokenizer_config.json", lambda c: c.update(eos_token="<|endoftext|>"))
    config = _run(small_dataset, tmp_path, path=str(model), tokenizer=str(smollm2_dir))
    result = train_here(run_cli, config, code=2)
    assert f"model.tokenizer {smollm2_dir} is not model.path {model}'s own tokenizer" in result.stderr
    assert "eos_token: the data's is '<|im_end|>', id 2; the model's own is '<|endoftext|>', id 0" in result.stderr
    assert f"--tokenizer {model} --out {small_dataset}-rebuilt" in result.stderr
    assert not (tmp_path / "run" / "final").exists()


def test_a_model_tokenizer_whose_ids_name_other_tokens_in_the_models_own_is_refused(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    """The model embeds as many ids as the data's tokenizer has, and its own tokenizer (8 tokens) puts bos and eos
    at the same ids, but every other id the data may use names another token, or none, in it."""
    model = _model(tmp_path / "model", 49152)
    _small_tokenizer(model)
    result = train_here(run_cli, _run(small_dataset, tmp_path, path=str(model), tokenizer=str(smollm2_dir)), code=2)
    assert f"model.tokenizer {smollm2_dir} is not model.path {model}'s own tokenizer" in result.stderr
    assert "have another id in the model's own tokenizer (8 tokens; the data's has 49152)" in result.stderr
    assert "eos_token" not in result.stderr and f"--tokenizer {model} --out" in result.stderr


def test_a_mismatch_in_the_chat_template_alone_still_offers_model_tokenizer(
    small_dataset, smollm2_dir, tmp_path, run_cli
):
    """The same vocabulary with another chat template: the ids name the same tokens, so pointing model.tokenizer
    at the data's tokenizer is safe and still offered, saying why."""
    model = _model(tmp_path / "model", 49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(smollm2_dir / name, model / name)
    (model / "chat_template.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    result = train_here(run_cli, _run(small_dataset, tmp_path, path=str(model)), code=2)
    assert "differing parts: chat_template" in result.stderr
    assert (
        "fix: point model.tokenizer at the tokenizer the datasets were built with (their ids name the same tokens: "
        "only the chat template or flags differ)"
    ) in result.stderr
