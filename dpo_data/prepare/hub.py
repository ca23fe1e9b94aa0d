"""`hf://datasets/OWNER/NAME[@REVISION]/GLOB` inputs: a Hub dataset repo's files, through huggingface_hub's cache."""

from __future__ import annotations

from pathlib import Path

from dpo_data.errors import DataError

HUB_PREFIX = "hf://datasets/"
_FORM = "hf://datasets/OWNER/NAME[@REVISION]/GLOB, e.g. hf://datasets/HuggingFaceH4/ultrafeedback_binarized/data/train_prefs-*.parquet"


def is_hub_input(path: str) -> bool:
    return path.startswith(HUB_PREFIX)


def hub_files(spec: str) -> list[str]:
    """The local paths of the files of `spec`'s dataset repo that GLOB matches, sorted: downloaded into
    huggingface_hub's cache (`HF_HUB_CACHE`), or found there without the network (`HF_HUB_OFFLINE=1`). The
    paths name the snapshot's commit, so the manifest records which revision was built."""
    owner, name, revision, pattern = _parts(spec)
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    try:
        local = snapshot_download(f"{owner}/{name}", repo_type="dataset", revision=revision, allow_patterns=[pattern])
    except (HfHubHTTPError, LocalEntryNotFoundError, OSError, ValueError) as e:
        raise DataError(
            f"input {spec}: cannot get dataset {owner}/{name} from the Hugging Face Hub ({type(e).__name__}: "
            f"{str(e).splitlines()[0]}). Fix: check the name and revision, the network or HF_TOKEN; offline, "
            "download it first (`hf download --repo-type dataset ...`) or pass its local files"
        ) from None
    files = sorted(str(p) for p in Path(local).glob(pattern) if p.is_file())
    if not files:
        raise DataError(
            f"input {spec}: no file of dataset {owner}/{name} matches {pattern!r}. Fix: list the repo's files "
            "(its 'Files' tab, or `hf download --dry-run`) and give a GLOB that matches the split's files"
        )
    return files


def _parts(spec: str) -> tuple[str, str, str | None, str]:
    owner, _, rest = spec[len(HUB_PREFIX) :].partition("/")
    name, _, pattern = rest.partition("/")
    name, at, revision = name.partition("@")
    if not owner or not name or not pattern or (at and not revision):
        raise DataError(f"input {spec!r} is not a Hub input; allowed: {_FORM}")
    return owner, name, revision or None, pattern
