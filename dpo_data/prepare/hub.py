"""The Hugging Face Hub: `hf://datasets/OWNER/NAME[@REVISION]/GLOB` inputs (a Hub dataset repo's files, through
huggingface_hub's cache), what is a Hub repo id, and what the local cache holds without the network."""

from __future__ import annotations

import re
from pathlib import Path, PurePosixPath

from dpo_data.errors import DataError

HUB_SCHEME = "hf://"
HUB_PREFIX = "hf://datasets/"
_FORM = "hf://datasets/OWNER/NAME[@REVISION]/GLOB, e.g. hf://datasets/HuggingFaceH4/ultrafeedback_binarized/data/train_prefs-*.parquet"


def is_hub_input(path: str) -> bool:
    """Any hf:// path: a dataset's is read, any other kind is a named error (never "no such file")."""
    return path.startswith(HUB_SCHEME)


def hub_files(spec: str) -> list[str]:
    """The local paths of the files of `spec`'s dataset repo that GLOB matches, sorted: downloaded into
    huggingface_hub's cache (`HF_HUB_CACHE`), or found there without the network (`HF_HUB_OFFLINE=1`). The
    paths name the snapshot's commit, so the manifest records which revision was built. Every file must lie in
    that snapshot, or in its repo's blob store where the cache links it: a file outside is no file of the repo."""
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
    snapshot = Path(local)
    files = sorted(str(p) for p in snapshot.glob(pattern) if p.is_file())
    for path in files:
        _check_in_snapshot(spec, snapshot, Path(path))
    if not files:
        raise DataError(
            f"input {spec}: no file of dataset {owner}/{name} matches {pattern!r}. Fix: list the repo's files "
            "(its 'Files' tab, or `hf download --dry-run`) and give a GLOB that matches the split's files"
        )
    return files


def _check_in_snapshot(spec: str, snapshot: Path, path: Path) -> None:
    """`path` (or what it links to) lies in the snapshot, or in the blob store of the repo's cache beside it
    (huggingface_hub links a snapshot's files to `../../blobs/<hash>`)."""
    resolved = path.resolve()
    roots = [snapshot.resolve()]
    if snapshot.parent.name == "snapshots":
        roots.append((snapshot.parent.parent / "blobs").resolve())
    if not any(resolved.is_relative_to(root) for root in roots):
        raise DataError(
            f"input {spec}: {path} leads to {resolved}, outside the dataset's snapshot {snapshot} and its blob store, "
            "so it is no file of the repo at that commit. Fix: remove that link from the Hugging Face cache and "
            "download the dataset again (`hf download --repo-type dataset ...`)"
        )


def _parts(spec: str) -> tuple[str, str, str | None, str]:
    if not spec.startswith(HUB_PREFIX):
        kind = spec[len(HUB_SCHEME) :].partition("/")[0]
        raise DataError(
            f"input {spec}: only hf://datasets/... is supported as an input, not hf://{kind}/... (a model or "
            f"space repo holds no training rows); allowed: {_FORM}"
        )
    owner, _, rest = spec[len(HUB_PREFIX) :].partition("/")
    name, _, pattern = rest.partition("/")
    name, at, revision = name.partition("@")
    if not owner or not name or not pattern or (at and not revision):
        raise DataError(f"input {spec!r} is not a Hub input; allowed: {_FORM}")
    if pattern.startswith("/") or ".." in PurePosixPath(pattern).parts:
        raise DataError(
            f"input {spec}: GLOB {pattern!r} is {'absolute' if pattern.startswith('/') else 'climbing out with ..'}; "
            "a GLOB names files inside the dataset repo, relative to its root (e.g. data/train-*.parquet)"
        )
    return owner, name, revision or None, pattern


HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[\w.-]+)?")
"""A Hugging Face repo id, NAME or OWNER/NAME: what transformers and datasets read a name as when no local path of
that name exists."""

DATA_SUFFIXES = (".jsonl", ".json", ".parquet", ".arrow", ".csv")
"""Names that are files, never a Hub id."""


def is_hub_id(value: str) -> bool:
    """A name that can only be a Hub repo id when no such local path exists (not /abs, ./rel, ../x, x.jsonl)."""
    return HUB_ID.fullmatch(value) is not None and ".." not in value and not value.endswith(DATA_SUFFIXES)


def hub_cache() -> str:
    """Where huggingface_hub keeps its cache (HF_HUB_CACHE), for messages."""
    from huggingface_hub import constants

    return constants.HF_HUB_CACHE


def cached_snapshot(repo_id: str, repo_type: str, needs: str = "") -> str | None:
    """The directory of `repo_id`'s snapshot in the local Hugging Face cache (its main revision), found without
    the network, holding `needs`; None when the cache has none."""
    from huggingface_hub import snapshot_download

    try:
        local = snapshot_download(repo_id, repo_type=repo_type, local_files_only=True)
    except Exception:  # noqa: BLE001 - LocalEntryNotFoundError, HFValidationError, OSError: all "not in the cache"
        return None
    return local if not needs or (Path(local) / needs).is_file() else None


def build_input(name: str, split: str) -> str:
    """What `dpo-data build` reads for a dataset name as load_dataset takes one (TRL's dataset_name): a local path
    as it is, a Hub dataset's split as hf://datasets/NAME/GLOB, the GLOB matching that split's files in the local
    cache, else the layout the Hub's push_to_hub writes (data/SPLIT-*)."""
    if Path(name).expanduser().exists() or not is_hub_id(name):
        return name
    return f"{HUB_PREFIX}{name}/{_split_glob(name, split)}"


def _split_glob(name: str, split: str) -> str:
    """The GLOB of `split`'s files (SPLIT-*.EXT, or the one file) in one folder of the cached snapshot; without
    a snapshot, or with the split's files spread out, data/SPLIT-*."""
    local = cached_snapshot(name, "dataset")
    files = [path for path in sorted(Path(local).rglob(f"{split}[-.]*")) if path.is_file()] if local else []
    kinds = {(path.parent.relative_to(local).as_posix(), path.suffix) for path in files}
    if len(kinds) != 1:
        return f"data/{split}-*"
    if len(files) == 1:
        return files[0].relative_to(local).as_posix()
    folder, suffix = kinds.pop()
    return f"{'' if folder == '.' else folder + '/'}{split}-*{suffix}"
