"""Which token ids decode to whitespace alone, from the dataset's own tokenizer (its attestation checked)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dpo_data.dataset.store import PairStore
from dpo_data.errors import DataError


def whitespace_ids(store: PairStore, tokenizer_dir: str | Path) -> np.ndarray:
    """Per id of the vocabulary, whether it decodes (alone) to whitespace and nothing else. The tokenizer at
    `tokenizer_dir` (a vision dataset's: its processor's) must be the one the datasets were built with."""
    from dpo_state.attestation import attestation_mismatch, tokenizer_attestation

    tokenizer = _load(store, tokenizer_dir)
    if store.chat_template is not None:  # as verify and dpo-train do: the build's --chat-template replaces its own
        tokenizer.chat_template = store.chat_template["text"]
    mismatch = attestation_mismatch(
        store.tokenizer_attestation, tokenizer_attestation(tokenizer), f"--tokenizer {tokenizer_dir}", "the dataset"
    )
    if mismatch is not None:
        raise DataError(f"{mismatch}; pass the directory of the tokenizer the dataset was built with")
    backend = tokenizer.backend_tokenizer
    texts = backend.decode_batch([[i] for i in range(backend.get_vocab_size(with_added_tokens=True))], False)
    return np.array([bool(text) and not text.strip() for text in texts], bool)


def _load(store: PairStore, directory: str | Path):
    if store.vision:
        from dpo_data.processor import load_processor, rendering_tokenizer

        return rendering_tokenizer(load_processor(directory))
    from dpo_data.tokenizer import load_tokenizer

    try:
        return load_tokenizer(directory)
    except (OSError, ValueError) as e:
        raise DataError(f"--tokenizer {directory}: cannot load a tokenizer ({e}); give the dataset's own") from None
