"""Tokenizer attestation v2: a portable fingerprint of what a tokenizer does, not of where its files lie."""

from __future__ import annotations

import weakref
from typing import Any

import orjson

from dpo_state.digest import sha256_json
from dpo_state.errors import AttestationError

TOKENIZER_ATTESTATION_VERSION = 2
_PREFIX = f"v{TOKENIZER_ATTESTATION_VERSION}:"

# Behaviour flags that change the ids a tokenizer produces or how its text is cleaned on decode.
# padding_side, truncation_side and model_max_length are left out: trainers set them at run time and
# they never change the ids of an untruncated, unpadded encode.
_FLAGS = ("add_bos_token", "add_eos_token", "clean_up_tokenization_spaces", "split_special_tokens")

# One attestation per live tokenizer object, invalidated when its added tokens or template change.
_cache: weakref.WeakKeyDictionary[Any, tuple[tuple, dict]] = weakref.WeakKeyDictionary()


def tokenizer_attestation(tokenizer: Any) -> dict:
    """Return `{"format_version": 2, "fingerprint": "v2:<sha256>", "components": {...}}` for a fast tokenizer.

    The fingerprint hashes canonical content: the backend (vocabulary, merges, normalizer,
    pre-tokenizer, post-processor, decoder) without its mutable truncation/padding state, the added
    tokens with ids and flags, the special tokens, the chat template and behaviour flags. Paths
    (`name_or_path`, `vocab_file`) are left out, so a copied directory attests the same.
    """
    key = _cache_key(tokenizer)
    hit = _cache.get(tokenizer)
    if hit is not None and hit[0] == key:
        return hit[1]
    components = {name: sha256_json(value) for name, value in _components(tokenizer).items()}
    attestation = {
        "format_version": TOKENIZER_ATTESTATION_VERSION,
        "fingerprint": _PREFIX + sha256_json(components),
        "components": components,
        "vocab_size": len(tokenizer),
    }
    _cache[tokenizer] = (key, attestation)
    return attestation


def attestation_problems(attestation: dict) -> list[str]:
    """Whether a recorded attestation is self-consistent: its fingerprint is the digest of its components."""
    return _digest_problems(attestation, _PREFIX, "tokenizer")


def _digest_problems(attestation: dict, prefix: str, what: str) -> list[str]:
    """The one problem of an attestation (`what`: tokenizer, processor) whose fingerprint is not `prefix` + the
    digest of its components, or none."""
    expected = prefix + sha256_json(attestation.get("components", {}))
    if attestation.get("fingerprint") != expected:
        return [
            f"{what} fingerprint {attestation.get('fingerprint')} is not the digest of the recorded "
            f"components ({expected}): the attestation was edited"
        ]
    return []


def attestation_mismatch(recorded: dict, actual: dict, actual_label: str, recorded_label: str) -> str | None:
    """None when two attestations agree; else one line naming both fingerprints and every differing component."""
    if actual["fingerprint"] == recorded["fingerprint"]:
        return None
    parts = differing_parts(recorded, actual)
    return (
        f"{actual_label} has fingerprint {actual['fingerprint']}, {recorded_label} was built with "
        f"{recorded['fingerprint']} (differing parts: {', '.join(parts)})"
    )


def differing_parts(recorded: dict, actual: dict) -> list[str]:
    """The components two attestations disagree on, in the recorded order (['unknown'] when none is named)."""
    parts = [k for k in recorded.get("components", {}) if recorded["components"][k] != actual["components"].get(k)]
    return parts or ["unknown"]


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """The `v2:`-prefixed fingerprint of `tokenizer_attestation`."""
    return tokenizer_attestation(tokenizer)["fingerprint"]


def _components(tokenizer: Any) -> dict[str, Any]:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise AttestationError(
            f"tokenizer {type(tokenizer).__name__} has no Rust backend (a slow tokenizer); "
            "attestation v2 needs a fast tokenizer: load it with use_fast=True"
        )
    spec = orjson.loads(backend.to_str())
    # to_str() records the last truncation/padding call: call state, not identity.
    spec.pop("truncation", None)
    spec.pop("padding", None)
    added = {
        str(i): {
            "content": t.content,
            "special": t.special,
            "lstrip": t.lstrip,
            "rstrip": t.rstrip,
            "normalized": t.normalized,
            "single_word": t.single_word,
        }
        for i, t in sorted(tokenizer.added_tokens_decoder.items())
    }
    special = {
        name: [value, tokenizer.convert_tokens_to_ids(value)]
        for name, value in sorted(tokenizer.special_tokens_map.items())
        if isinstance(value, str)
    }
    flags = {name: _plain(getattr(tokenizer, name, None)) for name in _FLAGS}
    return {
        "backend": spec,
        "added_tokens": added,
        "special_tokens": special,
        "chat_template": tokenizer.chat_template,
        "flags": flags,
    }


def _plain(value: Any) -> Any:
    """JSON-safe form of a flag value (huge model_max_length sentinels become strings)."""
    if isinstance(value, (bool, str)) or value is None:
        return value
    if isinstance(value, int):
        return value if abs(value) < 2**53 else str(value)
    return repr(value)


def _cache_key(tokenizer: Any) -> tuple:
    template = tokenizer.chat_template
    return (
        len(tokenizer),
        template if isinstance(template, str) else repr(template),
        tuple(sorted(map(str, tokenizer.special_tokens_map.items()))),
    )


# -- processors (vision datasets) ------------------------------------------------------------------

PROCESSOR_ATTESTATION_VERSION = 1
_PROCESSOR_PREFIX = f"p{PROCESSOR_ATTESTATION_VERSION}:"
# What a processor's to_dict holds besides its own settings: its parts (attested on their own, or not read: videos,
# audio) and load-time records.
_PROCESSOR_PARTS = frozenset(
    {"image_processor", "tokenizer", "video_processor", "audio_processor", "feature_extractor", "chat_template"}
)
_LOAD_TIME = frozenset({"auto_map", "processor_class", "_processor_class"})


def processor_attestation(processor: Any, tokenizer: dict) -> dict:
    """`{"format_version": 1, "fingerprint": "p1:<sha256>", "components": {...}, ...}` for a vision processor whose
    tokenizer attests as `tokenizer` (`tokenizer_attestation` of it with the chat template the build rendered with).

    Components (each the sha256 of canonical JSON): `image_processor`, its preprocessing config (`to_dict()`:
    sizes, patch and merge sizes, resampling, normalization, splitting) less load-time records; `processor`, the
    processor's own settings (its class, image token and id, e.g. Idefics3's `image_seq_len`) less its parts;
    `tokenizer`, the tokenizer's v2 fingerprint. Paths appear in none of them. `processor_class`, `image_token` and
    `image_token_id` are repeated beside them for readers; `image_processor_class` (the backend transformers
    picked: PIL or torchvision) is recorded there and not hashed: the ids a build writes do not depend on it."""
    image_processor = {
        k: v for k, v in processor.image_processor.to_dict().items() if k not in _LOAD_TIME and not k.startswith("_")
    }
    settings = {k: v for k, v in processor.to_dict().items() if k not in _PROCESSOR_PARTS and k not in _LOAD_TIME}
    image_token, image_token_id = _image_token(processor)
    settings.update(processor_class=type(processor).__name__, image_token=image_token, image_token_id=image_token_id)
    components = {
        "image_processor": sha256_json(image_processor),
        "processor": sha256_json(settings),
        "tokenizer": sha256_json(tokenizer["fingerprint"]),
    }
    return {
        "format_version": PROCESSOR_ATTESTATION_VERSION,
        "fingerprint": _PROCESSOR_PREFIX + sha256_json(components),
        "components": components,
        "processor_class": type(processor).__name__,
        "image_processor_class": type(processor.image_processor).__name__,
        "image_token": image_token,
        "image_token_id": image_token_id,
    }


def processor_attestation_problems(attestation: dict) -> list[str]:
    """Whether a recorded processor attestation is self-consistent: its fingerprint is the digest of its components."""
    return _digest_problems(attestation, _PROCESSOR_PREFIX, "processor")


def _image_token(processor: Any) -> tuple[str, int]:
    """The processor's image placeholder token and its id (the token its chat template writes for an image part)."""
    token = getattr(processor, "image_token", None)
    if not isinstance(token, str):
        raise AttestationError(
            f"processor {type(processor).__name__} names no image token (image_token); it cannot place images"
        )
    token_id = getattr(processor, "image_token_id", None)
    if token_id is None:
        token_id = processor.tokenizer.convert_tokens_to_ids(token)
    return token, int(token_id)
