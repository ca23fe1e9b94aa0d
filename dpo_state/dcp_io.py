"""Reading torch.distributed.checkpoint (DCP) directories safely: a restricted unpickler for DCP's metadata,
tensors only (no pickled items), and the split of optimizer state into tensors (DCP) and JSON (ours)."""

from __future__ import annotations

import contextlib
import enum
import pathlib
import pickle
import warnings
from pathlib import Path
from typing import Any

from dpo_state.errors import StateError

DCP_DIR = "dcp"
"""A checkpoint's DCP directory (model and optimizer tensors)."""
DCP_METADATA = f"{DCP_DIR}/.metadata"
"""DCP's index of the tensors, written last by DCP; a pickle, read here only through `_MetadataUnpickler`."""

_METADATA_CLASSES = {
    ("torch.distributed.checkpoint.metadata", name)
    for name in (
        "Metadata",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    )
} | {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),  # maps a layout's name ("torch.strided") to the layout object
    ("collections", "OrderedDict"),
}
"""Everything DCP's `.metadata` may name: DCP's own metadata classes, `torch.Size`, dtypes (checked apart),
layouts by name, paths (the checkpoint id, `_PATHS`) and ordered dicts. Nothing here runs code beyond building
plain values."""

_PATHS = {(module, name) for module in ("pathlib", "pathlib._local") for name in ("PosixPath", "WindowsPath")}
"""The checkpoint id's path classes, under the module each Python pickles them from: Python 3.13 moved them to
`pathlib._local`. Either name is read as `pathlib`'s class, so a checkpoint written by one Python reads on another."""

_TENSOR = {"$tensor": True}
"""Where `split_tensors` took a tensor out of a state tree (in the JSON part)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds only what `_METADATA_CLASSES` names (and torch dtypes); anything else is refused before it is built."""

    def __init__(self, file: Any, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) == ("builtins", "getattr"):
            return self._member  # some Python releases (3.11.2) pickle an enum's member as getattr(class, name)
        if (module, name) in _PATHS:
            return getattr(pathlib, name)
        if (module, name) in _METADATA_CLASSES or (module == "torch" and _is_dtype(name)):
            return super().find_class(module, name)
        raise StateError(
            f"{self.path}: refusing to unpickle it: it names {module}.{name}, which DCP metadata never holds "
            "(only DCP's metadata classes, torch.Size, dtypes and layouts are allowed); the file was replaced, "
            "and a checkpoint that anyone else could write must not be loaded"
        )

    def _member(self, cls: Any, name: Any) -> Any:
        """`getattr(cls, name)` where that is how the pickle names a member of an enum this unpickler builds
        (`_MEM_FORMAT_ENCODING`); any other attribute of anything is refused: a general getattr would reach
        past the allowed classes to whatever their attributes hold."""
        if isinstance(cls, enum.EnumMeta) and isinstance(name, str) and name in cls.__members__:
            return cls[name]
        owner = cls.__qualname__ if isinstance(cls, type) else type(cls).__qualname__
        raise StateError(
            f"{self.path}: refusing to unpickle it: it asks builtins.getattr for {owner}.{str(name)[:80]}, where "
            "DCP metadata only ever names an enum's member; the file was replaced, and a checkpoint that anyone "
            "else could write must not be loaded"
        )

    def persistent_load(self, pid: Any) -> Any:
        raise StateError(
            f"{self.path}: refusing to unpickle it: it holds a persistent id, which DCP metadata never does"
        )


def _is_dtype(name: str) -> bool:
    import torch

    return isinstance(getattr(torch, name, None), torch.dtype)


def read_dcp_metadata(directory: str | Path) -> Any:
    """DCP's `Metadata` of `directory` (a checkpoint's `dcp/`), built by the restricted unpickler and checked
    to index tensors only: a non-tensor item would be read back with a general unpickler by DCP."""
    from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

    path = Path(directory) / ".metadata"
    if not path.is_file():
        raise StateError(f"{path} is missing; the checkpoint is incomplete")
    try:
        with open(path, "rb") as f:
            metadata = _MetadataUnpickler(f, path).load()
    except StateError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure to parse is a damaged file, named with its cause
        raise StateError(f"{path}: not readable DCP metadata ({type(e).__name__}: {e})") from None
    if not isinstance(metadata, Metadata):
        raise StateError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
    items = getattr(metadata, "state_dict_metadata", None)
    if not isinstance(items, dict):
        raise StateError(f"{path}: DCP metadata without a tensor index")
    pickled = sorted(key for key, value in items.items() if not isinstance(value, TensorStorageMetadata))
    if pickled:
        raise StateError(
            f"{path}: indexes {len(pickled)} non-tensor item(s) ({', '.join(pickled[:3])}...), which DCP would "
            "unpickle with a general unpickler; checkpoints of this version hold tensors only (non-tensor state "
            "is JSON). A checkpoint of format 1 cannot be loaded by this version: resume it with the version "
            "that wrote it, or start afresh"
        )
    return metadata


def safe_reader(directory: str | Path) -> Any:
    """A DCP `FileSystemReader` for `directory` whose metadata goes through `read_dcp_metadata`. Tensor
    data itself DCP reads with torch's weights-only unpickler."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import StorageMeta

    class _SafeReader(FileSystemReader):
        def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
            metadata = read_dcp_metadata(directory)
            if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader.read_metadata does
                metadata.storage_meta = StorageMeta()
            metadata.storage_meta.load_id = self.load_id
            return metadata

    return _SafeReader(str(directory))


@contextlib.contextmanager
def quiet_single_process_dcp():
    """DCP warns that an uninitialized process group means a single-process save or load: intended here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*single process.*")
        yield


@contextlib.contextmanager
def reading_tensors(directory: str | Path):
    """Around a DCP load from `directory`: any failure to read the tensors (damaged or replaced data that
    torch's weights-only unpickler refuses, a missing key, a shape mismatch) becomes a named `StateError`."""
    from torch.distributed.checkpoint.api import CheckpointException  # a BaseException, not an Exception

    try:
        with quiet_single_process_dcp():
            yield
    except StateError:
        raise
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP wraps every cause; name it once here
        cause = str(e).strip().splitlines()
        raise StateError(
            f"{directory}: DCP could not read its tensors ({type(e).__name__}: "
            f"{cause[-1] if cause else ''}); the checkpoint is damaged or was replaced"
        ) from None


def split_tensors(tree: Any, where: str = "") -> tuple[Any, Any]:
    """(tensors, plain): the tensor leaves of a state tree (dicts; lists become dicts keyed "0", "1", ...)
    for DCP, and the rest as JSON values with `{"$tensor": true}` where a tensor was. Raises `StateError`
    naming a leaf that is neither a tensor nor JSON (str, number, bool, None)."""
    import torch

    if torch.is_tensor(tree):
        return tree, dict(_TENSOR)
    if isinstance(tree, dict):
        pairs = {str(k): split_tensors(v, f"{where}.{k}" if where else str(k)) for k, v in tree.items()}
    elif isinstance(tree, (list, tuple)):
        pairs = {str(i): split_tensors(v, f"{where}[{i}]") for i, v in enumerate(tree)}
    elif tree is None or isinstance(tree, (str, bool, int, float)):
        return None, tree
    else:
        raise StateError(
            f"{where}: a {type(tree).__name__} in the optimizer state; only tensors and JSON values "
            "can be checkpointed safely"
        )
    tensors = {k: t for k, (t, _) in pairs.items() if t is not None}
    plain = {k: p for k, (_, p) in pairs.items()}
    if isinstance(tree, dict):
        if any(not isinstance(k, str) for k in tree):
            raise StateError(f"{where or '(root)'}: non-string keys in the optimizer state cannot be stored as JSON")
        return (tensors or None), plain
    return (tensors or None), [plain[str(i)] for i in range(len(tree))]


def merge_tensors(plain: Any, tensors: Any) -> Any:
    """The inverse of `split_tensors`: the JSON part with each `{"$tensor": true}` replaced by its tensor."""
    if plain == _TENSOR:
        return tensors
    if isinstance(plain, dict):
        return {k: merge_tensors(v, (tensors or {}).get(k)) for k, v in plain.items()}
    if isinstance(plain, list):
        return [merge_tensors(v, (tensors or {}).get(str(i))) for i, v in enumerate(plain)]
    return plain
