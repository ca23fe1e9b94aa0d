"""Before the first step: the data is intact, the run's tokenizer is its data's, the model embeds every token id."""

from __future__ import annotations

from typing import Any

from dpo_data.dataset.store import PairStore
from dpo_data.dataset.verify import shard_problems
from dpo_data.errors import DataError
from dpo_data.progress import say
from dpo_data.tokenizer import load_tokenizer
from dpo_state.attestation import attestation_mismatch, tokenizer_attestation
from dpo_train.config.sections import TrainConfig
from dpo_train.errors import ConfigError
from dpo_train.parallel import collectives
from dpo_train.run.vocabulary import beyond_rows, check_declared_rows, check_own_tokenizer, mismatch_fix


def check_data(stores: dict[str, PairStore], mode: str, rank: int, world: int) -> None:
    """Refuse (DataError, on every rank) shards that differ from their manifests: size, and sha256 with
    `data.verify: full`. The ranks share the shards (rank r checks every world-th), hash in threads, and
    agree on the verdict. Manifests were already checked for self-consistency when the stores opened."""
    failure = ""
    try:
        problems = [p for store in stores.values() for p in shard_problems(store.dirs, mode, (rank, world))]
        failure = "\n  - ".join(problems)
    except DataError as e:
        failure = str(e)
    failures = collectives.gather_failures(failure)
    if failures:
        raise DataError(
            "the data does not match its manifests; refusing to train on it:\n  - "
            + "\n  - ".join(failures)
            + "\n  fix: rebuild the dataset, or restore its files; "
            "`dpo-data verify DIR` names every problem"
        )


def load_run_tokenizer(config: TrainConfig) -> Any | None:
    """The tokenizer of `model.tokenizer`, else of `model.path`; None for a random init without one. Loaded as
    `dpo-data build` loads it (`load_tokenizer`: one rule for what does not load), as AutoTokenizer's own object,
    which the export saves."""
    directory = config.model.tokenizer or config.model.path
    if not directory:
        return None
    key = "model.tokenizer" if config.model.tokenizer else "model.path"
    published = "the directory of the tokenizer the model was trained with, as published"
    fix = f"set model.tokenizer to {published}" if key == "model.path" else f"give {published}"
    try:
        return load_tokenizer(directory, savable=True)
    except (OSError, ValueError) as e:
        raise ConfigError(f"{key} {directory}: cannot load a tokenizer ({e}); {fix}") from None


def apply_dataset_template(tokenizer: Any | None, config: TrainConfig, key: str, store: PairStore, rank: int) -> None:
    """A dataset built with `--chat-template` attests that template, not the run tokenizer's own: the run's
    tokenizer takes it (said once, on rank 0), so `check_tokenizer` then compares every other attested part
    exactly and `final/` exports the template the model was trained with. The text was checked against the
    attestation when the manifest was read."""
    template = store.chat_template
    if tokenizer is None or template is None or tokenizer.chat_template == template["text"]:
        return
    tokenizer.chat_template = template["text"]
    if rank == 0:
        say(
            f"note: {key} {', '.join(store.dirs)} was built with --chat-template {template['file']} "
            f"({template['sha256']}); the run's tokenizer ({_label(config)}) uses that template instead of its own, "
            "and final/ saves it"
        )


def _label(config: TrainConfig) -> str:
    return f"model.tokenizer {config.model.tokenizer}" if config.model.tokenizer else f"model.path {config.model.path}"


def check_tokenizer(tokenizer: Any | None, config: TrainConfig, stores: dict[str, PairStore]) -> None:
    """Refuse (ConfigError) a run tokenizer whose attestation differs from any dataset's: `stores` maps a
    config key (data.path, eval.path) to its store. A precomputed reference is bound to the training
    data's fingerprint, which includes the tokenizer, so it is covered by data.path. The fix it names, and a
    model.tokenizer other than model.path's own, are checked against what the data's ids mean (vocabulary.py)."""
    if tokenizer is None:
        return
    actual = tokenizer_attestation(tokenizer)
    label = _label(config)
    problems = []
    for key, store in stores.items():  # a store's datasets share one tokenizer (PairStore checks)
        recorded_by = f"{key} {', '.join(store.dirs)}"
        mismatch = attestation_mismatch(
            store.tokenizer_attestation, actual, f"the run's tokenizer ({label})", recorded_by
        )
        if mismatch:
            problems.append(mismatch)
    if problems:
        raise ConfigError(
            "the run's tokenizer is not the one its data was built with:\n  - "
            + "\n  - ".join(problems)
            + f"\n  fix: {mismatch_fix(config, stores, actual)}; `dpo-data verify DIR --tokenizer DIR` shows the "
            "same comparison"
        )
    check_declared_rows(config, stores)
    check_own_tokenizer(tokenizer, config, stores)


def check_vocabulary(model: Any, stores: dict[str, PairStore]) -> None:
    """Refuse (ConfigError) a model with fewer embedding rows than a dataset's largest token id + 1, naming the
    fix (`vocabulary.beyond_rows`): the model's own name is its model.path, empty for a random init."""
    from dpo_train.model.policy import embedding_rows

    rows = embedding_rows(model)
    for key, store in stores.items():
        if store.max_token_id >= rows:
            raise ConfigError(beyond_rows(key, store, rows, getattr(model, "name_or_path", None) or None))


def check_sees_images(model: Any, stores: dict[str, PairStore]) -> None:
    """Refuse (ConfigError) a vision dataset with a model that has no vision tower: its images would be dropped."""
    from dpo_train.vision.families import tower_of

    for key, store in stores.items():
        if store.vision and tower_of(model) is None:
            raise ConfigError(
                f"{key} {', '.join(store.dirs)} holds images, but the model ({type(model).__name__}) is not a "
                "vision-language model and would train without them; set model.path to the vision-language model "
                "the data was built for (docs/vision.md)"
            )
