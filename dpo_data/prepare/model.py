"""What a build encodes with: the tokenizer or, for a vision build, the processor, loaded with the override chat
template in place and attested."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dpo_data.errors import DataError
from dpo_data.tokenizer import load_tokenizer
from dpo_state.attestation import processor_attestation, tokenizer_attestation


@dataclass(frozen=True)
class BuildModel:
    """What a build encodes with: the tokenizer and, for a vision build, the processor, with their attestations."""

    tokenizer: Any
    attestation: dict
    processor: Any = None
    processor_attestation: dict | None = None


def load_model(tokenizer_dir: str | None, processor_dir: str | None, template: dict | None) -> BuildModel:
    """The tokenizer (a vision build's: the processor's, with the processor's chat template), the override
    template in place (before the attestation, so the dataset attests the template it was built with)."""
    from dpo_data.processor import load_processor, rendering_tokenizer

    processor = None if processor_dir is None else load_processor(processor_dir)
    tokenizer = _load_tokenizer(tokenizer_dir) if processor is None else rendering_tokenizer(processor)
    if template is not None:
        tokenizer.chat_template = template["text"]
    attestation = tokenizer_attestation(tokenizer)
    if processor is None:
        return BuildModel(tokenizer, attestation)
    return BuildModel(tokenizer, attestation, processor, processor_attestation(processor, attestation))


def _load_tokenizer(tokenizer_dir: str) -> Any:
    try:
        return load_tokenizer(tokenizer_dir)
    except (OSError, ValueError) as e:
        raise DataError(f"--tokenizer {tokenizer_dir}: cannot load a tokenizer ({e})") from None
