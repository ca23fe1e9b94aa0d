"""What a model card's Hub metadata says of a run's inputs: the base model's Hub id and licence, the datasets' names."""

from __future__ import annotations

from pathlib import Path, PurePath

from dpo_data.dataset.manifest import read_manifest
from dpo_data.prepare.hub import is_hub_id
from dpo_state.files import read_json
from dpo_train.config.sections import ModelConfig
from dpo_train.model.bundled import HUB_ID, LICENSE, is_bundled

_LICENCE_KEYS = ("license", "license_name", "license_link")
"""The Hub's licence fields: an id from its list, or `other` with a name and a link."""
_CARD_BYTES = 1 << 20  # a model card is KBs: a larger README is not read for its front matter


def cached_repo_id(path: str | Path, kind: str) -> str | None:
    """ORG/NAME (or NAME) of a path inside huggingface_hub's cache, `KINDs--ORG--NAME/snapshots/REVISION/...`
    (`kind`: model or dataset); None for any other path. A repo id never holds `--`, so the folder name maps back."""
    parts = PurePath(path).parts
    prefix = f"{kind}s--"
    for k in range(len(parts) - 2):
        if parts[k + 1] == "snapshots" and parts[k].startswith(prefix) and len(parts[k]) > len(prefix):
            return parts[k][len(prefix) :].replace("--", "/")
    return None


def hub_model_id(model: ModelConfig) -> str | None:
    """The base model's Hub id where one is known: the bundled SmolLM2's, the repo of a Hugging Face cache
    snapshot (model.path as given or resolved), or the Hub name its config.json records as `_name_or_path`;
    None for a random init or a local directory of no known repo (a local name is no Hub id)."""
    if not model.path:
        return None
    if is_bundled(model.path):
        return HUB_ID
    for path in (model.path, Path(model.path).resolve()):
        if found := cached_repo_id(path, "model"):
            return found
    recorded = read_json(Path(model.path) / "config.json").get("_name_or_path")
    return recorded if isinstance(recorded, str) and is_hub_id(recorded) else None


def base_licence(model: ModelConfig) -> dict[str, str]:
    """The base model's licence as Hub metadata (`license`, and `license_name`/`license_link` for `other`):
    the bundled SmolLM2's, else what the front matter of the base directory's README.md (its Hub card) says;
    {} when nothing local states one (the card then claims none)."""
    if not model.path:
        return {}
    if is_bundled(model.path):
        return {"license": LICENSE}
    card = Path(model.path) / "README.md"
    if not card.is_file() or card.stat().st_size > _CARD_BYTES:
        return {}
    import yaml
    from huggingface_hub import metadata_load

    try:
        front = metadata_load(card) or {}
    except (yaml.YAMLError, ValueError):  # front matter that does not parse, or is no mapping, states no licence
        return {}
    found = {key: front[key] for key in _LICENCE_KEYS if isinstance(front.get(key), str) and front[key]}
    return found if "license" in found else {}


def dataset_names(paths: list[str]) -> list[str]:
    """The run's datasets as their builds read them, once each in order: the Hub id of an input that came from
    the Hub (`hf://datasets/...`, recorded as its cache snapshot's path), else the input's source name (its
    --source, or its file name without the suffix)."""
    names = []
    for path in paths:
        for entry in read_manifest(path)["inputs"]:
            names.append(cached_repo_id(entry["path"], "dataset") or entry["default_source"])
    return list(dict.fromkeys(names))
