"""Whether a dataset's token ids name the tokens the model learned: the fix a tokenizer mismatch suggests, the check
of a `model.tokenizer` other than the model's own, and the rebuild command both give."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path
from typing import Any

from dpo_data.dataset.manifest import read_manifest
from dpo_data.dataset.store import PairStore
from dpo_data.tokenizer import load_tokenizer
from dpo_state.attestation import tokenizer_attestation
from dpo_train.config.sections import ModelConfig, TrainConfig
from dpo_train.errors import ConfigError

VOCABULARY_PARTS = ("backend", "added_tokens", "special_tokens")
"""The attestation components that decide which token an id names; the others (chat_template, flags) change which
ids a text becomes, never what an id means."""
SPECIAL_IDS = ("bos_token", "eos_token")
"""The special tokens whose ids the data holds (the build writes them; padding is masked, never a pad id)."""
BUILD_FLAGS = {
    "max_length": "--max-length",
    "overlength": "--overlength",
    "source": "--source",
    "max_reject_fraction": "--max-reject-fraction",
    "pairs_per_shard": "--pairs-per-shard",
    "max_row_bytes": "--max-row-bytes",
}
"""Recorded build options and their `dpo-data build` flags (given in a rebuild command where not the default)."""


def mismatch_fix(config: TrainConfig, stores: dict[str, PairStore], actual: dict) -> str:
    """The fix for a run tokenizer (attesting `actual`) that is not the data's. Pointing model.tokenizer at the
    data's tokenizer trains model.path's weights on the data's ids: offered only where those ids name the same
    tokens (only the chat template or flags differ) or the model is a random init, which learns any vocabulary;
    otherwise the rebuild command, with what was checked."""
    foreign = [store for store in stores.values() if _vocabulary_differs(store.tokenizer_attestation, actual)]
    if not foreign or not config.model.path:
        same = "" if foreign else " (their ids name the same tokens: only the chat template or flags differ)"
        rebuild = rebuild_commands(stores, config.model.tokenizer or config.model.path)
        theirs = f"the tokenizer the datasets were built with{same}"
        return f"point model.tokenizer at {theirs}, or rebuild them with this one: {rebuild}"
    recorded = foreign[0].tokenizer_attestation
    rows = declared_rows(config.model)
    embeds = "" if rows is None else f"; model.path {config.model.path} embeds {rows} ids"
    return (
        f"rebuild them with the model's tokenizer: {rebuild_commands(stores, _model_tokenizer_dir(config.model))}. "
        f"Their tokenizer differs in what its ids mean ({recorded.get('vocab_size', '?')} tokens, the data's ids up "
        f"to {max(s.max_token_id for s in foreign)}; the run's: {actual.get('vocab_size', '?')} tokens{embeds}), so "
        "their ids may name other tokens than the ones this model learned: pointing model.tokenizer at their "
        "tokenizer would train it on those ids all the same"
    )


def check_own_tokenizer(tokenizer: Any, config: TrainConfig, stores: dict[str, PairStore]) -> None:
    """Refuse (ConfigError) a `model.tokenizer` other than model.path's own tokenizer where the data's ids would
    name other tokens to the model: a token of id up to the data's largest with another id (or none) in the
    model's own tokenizer, or a bos/eos of another id. A model.path without tokenizer files, or whose files do not
    load, has nothing to compare: model.tokenizer stands in for them."""
    own_dir = _own_tokenizer_dir(config.model)
    if own_dir is None:
        return
    try:
        own = load_tokenizer(own_dir)
    except (OSError, ValueError):
        return
    if not _vocabulary_differs(tokenizer_attestation(own), tokenizer_attestation(tokenizer)):
        return
    differences = _special_differences(tokenizer, own)
    differences += _id_differences(tokenizer, own, max(store.max_token_id for store in stores.values()))
    if differences:
        raise ConfigError(
            f"model.tokenizer {config.model.tokenizer} is not model.path {config.model.path}'s own tokenizer, and "
            "the data's ids would name other tokens to this model:\n  - "
            + "\n  - ".join(differences)
            + f"\n  fix: rebuild the data with the model's tokenizer, {rebuild_commands(stores, own_dir)}, and drop "
            "model.tokenizer"
        )


def check_declared_rows(config: TrainConfig, stores: dict[str, PairStore]) -> None:
    """Refuse (ConfigError), before the model loads, a model whose config declares fewer embedding rows than a
    dataset's largest token id + 1 (`check_vocabulary` checks the loaded model's rows as well)."""
    rows = declared_rows(config.model)
    for key, store in stores.items():
        if rows is not None and store.max_token_id >= rows:
            raise ConfigError(beyond_rows(key, store, rows, config.model.path))


def beyond_rows(key: str, store: PairStore, rows: int, model_path: str | None) -> str:
    """The refusal of a model embedding `rows` ids for data holding larger ones, with its fix: a random init (no
    model_path) declares more rows; a saved model's data is rebuilt with its tokenizer."""
    if model_path and _holds_tokenizer(model_path):
        fix = f"rebuild the data with the model's tokenizer: {rebuild_commands({key: store}, model_path)}"
    elif model_path:  # whatever built the data (model.tokenizer, if given) is not the model's: it is not named
        fix = (
            f"rebuild the data with the tokenizer the model was trained with (model.path {model_path} holds none): "
            f"{rebuild_commands({key: store}, 'MODEL_TOKENIZER_DIR')}"
        )
    else:
        fix = f"give model.init.config a vocab_size of at least {store.max_token_id + 1} (a random init's rows)"
    return (
        f"{key}: the datasets hold token id {store.max_token_id}, but the model embeds only {rows} ids (0 to "
        f"{rows - 1}): training would read past its embedding, or on other tokens' rows; fix: {fix}"
    )


def rebuild_commands(stores: dict[str, PairStore], tokenizer: str) -> str:
    """`dpo-data build` commands that rebuild every dataset of `stores` with `tokenizer`, their recorded inputs and
    options, each into a new directory beside the old (then set the config's key to it)."""
    commands = [
        f"`{rebuild_command(directory, tokenizer)}` (then set {key} to its --out)"
        for key, store in stores.items()
        for directory in store.dirs
    ]
    return "; ".join(commands)


def rebuild_command(directory: str, tokenizer: str) -> str:
    """The `dpo-data build` command that rebuilds the dataset in `directory` with `tokenizer`, shell-quoted."""
    from dpo_data.prepare.options import BuildOptions

    m = read_manifest(directory)
    options = m["producer"]["options"]
    defaults = {f.name: f.default for f in dataclasses.fields(BuildOptions)}
    out = f"{str(directory).rstrip('/')}-rebuilt"
    words = ["dpo-data build", *(shlex.quote(i["path"]) for i in m["inputs"])]
    words += ["--tokenizer", shlex.quote(str(tokenizer)), "--out", shlex.quote(out)]
    for name, flag in BUILD_FLAGS.items():
        if options.get(name) is not None and options[name] != defaults[name]:
            words += [flag, shlex.quote(str(options[name]))]
    if options.get("append_eos") is False:
        words.append("--no-eos")
    if options.get("columns"):
        words += ["--columns", shlex.quote(",".join(f"{k}={v}" for k, v in options["columns"].items()))]
    if options.get("chat_template"):
        words += ["--chat-template", shlex.quote(options["chat_template"]["file"])]
    return " ".join(words)


def declared_rows(model: ModelConfig) -> int | None:
    """The embedding rows the model's config declares (`vocab_size`, a vision-language model's `text_config`'s):
    model.path's config.json or model.init.config (a mapping or a file); None where it names none."""
    if not (model.init or model.path):
        return None
    spec = model.init.get("config") if model.init else str(Path(model.path) / "config.json")
    if isinstance(spec, str):
        path = Path(spec) / "config.json" if Path(spec).is_dir() else Path(spec)  # a file or a model directory
        try:
            spec = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, ValueError, RecursionError):  # the loaded model's rows are checked as well
            return None
    if not isinstance(spec, dict):
        return None
    text = spec.get("text_config")
    rows = spec.get("vocab_size", text.get("vocab_size") if isinstance(text, dict) else None)
    return rows if isinstance(rows, int) and not isinstance(rows, bool) else None


def _vocabulary_differs(recorded: dict, actual: dict) -> bool:
    return any(recorded["components"].get(part) != actual["components"].get(part) for part in VOCABULARY_PARTS)


def _own_tokenizer_dir(model: ModelConfig) -> str | None:
    """model.path where it holds tokenizer files and model.tokenizer names another directory; else None."""
    if not (model.path and model.tokenizer) or Path(model.path).resolve() == Path(model.tokenizer).resolve():
        return None
    return model.path if _holds_tokenizer(model.path) else None


def _model_tokenizer_dir(model: ModelConfig) -> str:
    """The model's own tokenizer: model.path's where it holds one, else the run's."""
    return model.path if model.path and _holds_tokenizer(model.path) else (model.tokenizer or model.path)


def _holds_tokenizer(directory: str) -> bool:
    return (Path(directory) / "tokenizer.json").is_file() or (Path(directory) / "tokenizer_config.json").is_file()


def _special_differences(tokenizer: Any, own: Any) -> list[str]:
    """bos/eos tokens whose id differs between the run's tokenizer (the data's) and the model's own."""
    differences = []
    for name in SPECIAL_IDS:
        ours, theirs = tokenizer.special_tokens_map.get(name), own.special_tokens_map.get(name)
        if not (isinstance(ours, str) and isinstance(theirs, str)):
            continue
        ours_id, theirs_id = tokenizer.convert_tokens_to_ids(ours), own.convert_tokens_to_ids(theirs)
        if ours_id != theirs_id:
            differences.append(
                f"{name}: the data's is {ours!r}, id {ours_id}; the model's own is {theirs!r}, id {theirs_id}"
            )
    return differences


def _id_differences(tokenizer: Any, own: Any, highest: int) -> list[str]:
    """The data tokenizer's tokens of id up to `highest` (the data's largest) that the model's own tokenizer gives
    another id or none, counted, with the first of them."""
    vocabulary = tokenizer.backend_tokenizer.get_vocab(with_added_tokens=True)
    theirs = own.backend_tokenizer.get_vocab(with_added_tokens=True)
    moved = sorted((i, token) for token, i in vocabulary.items() if i <= highest and theirs.get(token) != i)
    if not moved:
        return []
    first, token = moved[0]
    where = "is not in it" if token not in theirs else f"is id {theirs[token]} there"
    return [
        f"{len(moved)} of the tokens of id 0 to {highest} (the data's largest) have another id in the model's own "
        f"tokenizer ({len(own)} tokens; the data's has {len(tokenizer)}): the first, {token!r}, is id {first} in the "
        f"data and {where}"
    ]
