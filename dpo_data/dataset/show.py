"""`dpo-data show`: a dataset's pairs decoded as the model sees them, the template's text marked, each part counted."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from dpo_data.dataset.manifest import read_manifest
from dpo_data.dataset.shards import PARTS
from dpo_data.dataset.store import PairStore
from dpo_data.dataset.template_text import IMAGE, TEMPLATE, TEXT, TemplateSkeleton, origins, token_pieces
from dpo_data.dataset.verify import attested_tokenizer
from dpo_data.errors import DataError
from dpo_data.images import ImageError, open_image
from dpo_state.schema import validate

SHOW_FORMAT_VERSION = 1
DEFAULT_LIMIT = 3
"""Pairs shown without --limit (one with --pair)."""
OPEN, CLOSE = "\u27e6", "\u27e7"  # ⟦ ⟧: brackets no chat template or tokenizer uses, around the template's text


@dataclass(frozen=True)
class Viewer:
    """A dataset opened for reading its pairs as text, with the tokenizer it was built with."""

    data_dir: str
    store: PairStore
    tokenizer: Any
    special_ids: frozenset[int]
    image_token: int | None
    skeleton: TemplateSkeleton


def open_viewer(data_dir: str | Path, tokenizer_dir: str) -> Viewer:
    """`data_dir`'s pairs with `tokenizer_dir`'s tokenizer (a vision dataset: its processor), which must be the one
    the dataset attests: decoding ids with another vocabulary would show another text."""
    m = read_manifest(data_dir)
    attested = attested_tokenizer(m, tokenizer_dir)
    if attested.tokenizer is None:
        raise DataError("; ".join(attested.failures))
    if attested.failures:
        raise DataError(
            f"--tokenizer {tokenizer_dir} is not the tokenizer {data_dir} was built with, and its ids would decode "
            f"to another text: {'; '.join(attested.failures)}"
        )
    tokenizer = attested.tokenizer
    special_ids = frozenset(i for i, token in tokenizer.added_tokens_decoder.items() if token.special)
    return Viewer(
        str(data_dir),
        PairStore([data_dir]),
        tokenizer,
        special_ids,
        _image_token(attested.processor, tokenizer),
        TemplateSkeleton(tokenizer),
    )


def select_pairs(store: PairStore, pair: int | None, source: str | None, limit: int | None) -> list[int]:
    """The pairs to show: `limit` from `pair` on, or the first `limit` of `source`, or of the dataset."""
    if pair is not None and source is not None:
        raise DataError(f"--pair {pair} and --source {source}: give one of them (or neither, for the first pairs)")
    if limit is not None and limit < 1:
        raise DataError(f"--limit {limit}: give a positive number of pairs to show")
    n = store.num_pairs
    if pair is not None:
        if not 0 <= pair < n:
            raise DataError(f"--pair {pair}: {store.dirs[0]} holds {n} pairs; give an index from 0 to {n - 1}")
        return list(range(pair, min(n, pair + (limit or 1))))
    limit = limit or DEFAULT_LIMIT
    if source is None:
        return list(range(min(n, limit)))
    if source not in store.sources:
        counts = np.bincount(store.source_id, minlength=len(store.sources))
        known = ", ".join(f"{name} ({count} pairs)" for name, count in zip(store.sources, counts))
        raise DataError(f"--source {source}: {store.dirs[0]} has no such source; its sources: {known}")
    return np.flatnonzero(store.source_id == store.sources.index(source))[:limit].tolist()


def pair_document(viewer: Viewer, index: int) -> dict[str, Any]:
    """Pair `index` as `dpo-data show --json` prints it (schemas/show.schema.json): each part's ids, their decoded
    pieces and origins, and counts taken from the stored ids, never from a re-tokenized text."""
    store = viewer.store
    ids = store.pair(index)
    backend = viewer.tokenizer.backend_tokenizer
    lists = {part: getattr(ids, part).tolist() for part in PARTS}
    pieces = {part: token_pieces(backend, lists[part]) for part in PARTS}
    texts = {part: "".join(pieces[part]) for part in PARTS}
    found = viewer.skeleton.prompt_content(texts["prompt"])
    roles, content = (None, dict.fromkeys(PARTS)) if found is None else (found[0], {"prompt": found[1]})
    for part in PARTS[1:]:
        if roles is not None:
            content[part] = viewer.skeleton.completion_content(roles, texts[part])
    parts = {
        part: _part(lists[part], pieces[part], content[part], viewer.special_ids, viewer.image_token) for part in PARTS
    }
    doc = {
        "format_version": SHOW_FORMAT_VERSION,
        "dataset": viewer.data_dir,
        "dataset_fingerprint": store.fingerprint,
        "pair": int(index),
        "source": store.sources[ids.source_id],
        "template": {"matched": roles is not None, "roles": None if roles is None else list(roles)},
        "parts": parts,
        "images": _images(store, index, parts["prompt"]["origin"], store.max_image_pixels),
    }
    validate("show", doc, "dpo-data show document")
    return doc


def _part(ids: list[int], pieces: list[str], content: list | None, special_ids, image_token) -> dict[str, Any]:
    marks = origins(ids, pieces, content, special_ids, image_token)
    return {
        "tokens": len(ids),
        **{origin: marks.count(origin) for origin in (TEMPLATE, TEXT, IMAGE)},
        "ids": ids,
        "pieces": pieces,
        "origin": marks,
        "content": None if content is None else [list(span) for span in content],
    }


def _image_token(processor: Any, tokenizer: Any) -> int | None:
    """The id of a vision processor's image placeholder (the token it repeats per image patch); None for text."""
    if processor is None:
        return None
    token_id = getattr(processor, "image_token_id", None)
    if token_id is None and getattr(processor, "image_token", None) is not None:
        token_id = tokenizer.convert_tokens_to_ids(str(processor.image_token))
    return None if token_id is None else int(token_id)


def _images(store: PairStore, index: int, marks: list[str], max_pixels: int | None) -> list[dict[str, Any]]:
    """The pair's images as stored (digest, bytes, declared size), each at its run of placeholder tokens in the
    prompt where the prompt holds one run per image (a processor that splits an image into tiles makes several)."""
    runs = _runs(marks, IMAGE)
    stored = store.images(index)
    out = []
    for k, (data, digest) in enumerate(stored):
        try:
            width, height = open_image(data, max_pixels).size
        except ImageError:  # shown as unknown; dpo-data verify names what is wrong with it
            width = height = None
        at = list(runs[k]) if len(runs) == len(stored) else None
        out.append({"index": k, "sha256": digest, "bytes": len(data), "width": width, "height": height, "tokens": at})
    return out


def _runs(marks: list[str], origin: str) -> list[tuple[int, int]]:
    """[start, stop) of each run of consecutive tokens of `origin`."""
    runs, start = [], None
    for i, mark in enumerate([*marks, None]):
        if mark == origin and start is None:
            start = i
        elif mark != origin and start is not None:
            runs.append((start, i))
            start = None
    return runs


def format_pair(doc: dict[str, Any]) -> str:
    """The terminal form of `pair_document`: the counts, then each part's text with the template's ⟦marked⟧."""
    parts = doc["parts"]
    template = doc["template"]
    how = (
        f"matched as a conversation of {_roles(template['roles'])}: {OPEN}marked{CLOSE} text is the chat "
        "template's or the build's, the rest the row's messages"
        if template["matched"]
        else f"special tokens alone are {OPEN}marked{CLOSE}: no rendering of the chat template matches this prompt "
        "(a plain-text row, a truncated prompt, tools, or a template that renders differently now; docs/data-build.md)"
    )
    lines = [
        f"pair {doc['pair']}  source {doc['source']}  ({doc['dataset']})",
        " | ".join(f"{part} {parts[part]['tokens']} tokens ({_split(parts[part])})" for part in PARTS),
        f"template: {how}",
    ]
    images = {image["tokens"][0]: image for image in doc["images"] if image["tokens"] is not None}
    for part in PARTS:
        lines += [f"--- {part} ---", _marked(parts[part], images if part == "prompt" else {})]
    unplaced = [image for image in doc["images"] if image["tokens"] is None]
    lines += [f"image {_image(image)} (its placeholder tokens are not one run per image)" for image in unplaced]
    return "\n".join(lines)


def _roles(roles: list[str]) -> str:
    """`system, user`, or for a long conversation its length and ends: `41 messages (user, assistant, ..., user)`."""
    if len(roles) <= 6:
        return ", ".join(roles)
    return f"{len(roles)} messages ({', '.join(roles[:2])}, ..., {roles[-1]})"


def _split(part: dict[str, Any]) -> str:
    counts = [f"{origin} {part[origin]}" for origin in (TEMPLATE, TEXT, IMAGE) if part[origin] or origin != IMAGE]
    return ", ".join(counts)


def _marked(part: dict[str, Any], images: dict[int, dict]) -> str:
    """The part's decoded text, each run of template tokens in brackets and each run of image tokens one bracket
    naming its image (or its count)."""
    out, marks, pieces = [], part["origin"], part["pieces"]
    for start, stop in _runs(marks, TEMPLATE) + _runs(marks, IMAGE) + _runs(marks, TEXT):
        text = "".join(pieces[start:stop])
        if marks[start] == TEXT:
            out.append((start, text))
        elif marks[start] == TEMPLATE:
            out.append((start, f"{OPEN}{text}{CLOSE}"))
        else:
            named = f" image {_image(images[start])}" if start in images else ""
            out.append((start, f"{OPEN}{pieces[start] or 'image'} x{stop - start}{named}{CLOSE}"))
    return "".join(text for _, text in sorted(out))


def _image(image: dict[str, Any]) -> str:
    size = "size unknown" if image["width"] is None else f"{image['width']}x{image['height']}"
    return f"{image['index']}: sha256 {image['sha256'][:16]}..., {image['bytes']} bytes, {size}"
