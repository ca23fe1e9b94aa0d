"""Random access to the pairs of one or more built datasets, memory-mapped, with per-pair lengths in memory."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from dpo_data.dataset.manifest import (
    is_vision,
    max_row_image_pixels,
    read_manifest,
    recorded_chat_template,
    template_origin,
)
from dpo_data.dataset.shards import as_numpy
from dpo_data.errors import DataError
from dpo_state.attestation import differing_parts
from dpo_state.digest import DIGEST_PREFIX, sha256_json


@dataclass(frozen=True)
class PairIds:
    """One pair's token ids (int32 views into the memory-mapped shard) and its identity."""

    index: int
    source_id: int
    prompt: np.ndarray
    chosen: np.ndarray
    rejected: np.ndarray


class PairStore:
    """The pairs of datasets `dirs`, in that order: global pair index = offset of its dataset + its row.

    Lengths, source ids and row locations live in memory (28 bytes a pair); ids stay in the memory-mapped shards and
    are read as zero-copy views. Source names are merged across datasets by name. The store pickles
    as its paths (workers reopen the maps), so it can be handed to DataLoader workers.
    """

    def __init__(self, dirs: list[str | Path]):
        if not dirs:
            raise DataError("no dataset directory given")
        self.dirs = [str(d) for d in dirs]
        manifests = [read_manifest(d) for d in self.dirs]
        self.vision = _one_processor(self.dirs, manifests)
        self.tokenizer_fingerprint = _one_tokenizer(self.dirs, manifests)
        self.dataset_fingerprints = [m["fingerprint"] for m in manifests]
        self.fingerprint = (
            self.dataset_fingerprints[0] if len(dirs) == 1 else DIGEST_PREFIX + sha256_json(self.dataset_fingerprints)
        )
        self.sources: list[str] = []
        for m in manifests:
            for s in m["sources"]:
                if s["name"] not in self.sources:
                    self.sources.append(s["name"])
        self.dataset_sizes = [m["totals"]["pairs"] for m in manifests]
        self.max_token_id = max(m["totals"]["max_token_id"] for m in manifests)
        self.dataset_offsets = np.concatenate([[0], np.cumsum(self.dataset_sizes)]).astype(np.int64)
        self._manifests = manifests
        self._open()

    @property
    def tokenizer_attestation(self) -> dict:
        """The tokenizer attestation (v2) the datasets were built with (one tokenizer for all of them)."""
        return self._manifests[0]["tokenizer"]

    @property
    def chat_template(self) -> dict | None:
        """The `--chat-template` override the datasets were built with (file, sha256, text), or None. One
        tokenizer attestation for all means one template text, so the first dataset recording one speaks for all."""
        return next((t for t in map(recorded_chat_template, self._manifests) if t is not None), None)

    @property
    def processor_attestation(self) -> dict | None:
        """A vision store's processor attestation (one processor for all its datasets); None for text data."""
        return self._manifests[0]["processor"] if self.vision else None

    @property
    def max_image_pixels(self) -> int | None:
        """The --max-image-pixels a vision store's images were built under (the smallest of its datasets')."""
        if not self.vision:
            return None
        return min(m["producer"]["options"]["max_image_pixels"] for m in self._manifests)

    @property
    def max_row_image_pixels(self) -> int | None:
        """The --max-row-image-pixels a vision store's rows were built under (the smallest of its datasets'; a
        dataset that records none: the default, `manifest.max_row_image_pixels`)."""
        if not self.vision:
            return None
        return min(max_row_image_pixels(m) for m in self._manifests)

    @property
    def num_pairs(self) -> int:
        return int(self.dataset_offsets[-1])

    def segment_tokens(self, indices: np.ndarray, layout: str = "separate") -> np.ndarray:
        """Input tokens of each pair: both segments, the prompt counted twice ('separate') or once
        ('shared_prompt')."""
        prompts = self.prompt_len[indices] * (2 if layout == "separate" else 1)
        return prompts + self.chosen_len[indices] + self.rejected_len[indices]

    def pair(self, index: int) -> PairIds:
        batch, row = self._batch_of[index], self._row_of[index]
        parts = [offsets_values[batch] for offsets_values in self._parts]
        views = [values[offsets[row] : offsets[row + 1]] for offsets, values in parts]
        return PairIds(int(index), int(self.source_id[index]), *views)

    def images(self, index: int) -> list[tuple[bytes, str]]:
        """Pair `index`'s images as stored, in placeholder order: (original bytes, recorded hex sha256) each; []
        for a pair without images or a text store. The bytes are not checked here (`dpo_data.loading.images`)."""
        if not self.vision:
            return []
        data, digests = self._images[int(self._batch_of[index])]
        row = int(self._row_of[index])
        return list(zip(data[row].as_py(), digests[row].as_py()))

    def __getstate__(self):
        return {"dirs": self.dirs}

    def __setstate__(self, state):
        self.__init__(state["dirs"])

    def locate(self, index: int) -> tuple[str, str]:
        """Where global pair `index` lives: (its dataset directory, its shard's path in that dataset)."""
        return self._located[int(self._batch_of[index])]

    def _open(self) -> None:
        self._located: list[tuple[str, str]] = []  # (dataset, shard) of every record batch, in order
        lengths, sources, parts, batch_of, row_of = [], [], [[], [], []], [], []
        self._images: list[tuple[pa.Array, pa.Array]] = []  # a vision store's image columns, per record batch
        for d, m in zip(self.dirs, self._manifests):
            for shard in m["shards"]:
                remap = np.array([self.sources.index(name) for name in shard["sources"]], dtype=np.int32)
                path = Path(d) / shard["path"]
                try:
                    for batch in _batches(path, shard["rows"]):
                        k = len(parts[0])
                        for j, column in enumerate(("prompt_ids", "chosen_ids", "rejected_ids")):
                            arr = batch.column(column)
                            parts[j].append((as_numpy(arr.offsets), as_numpy(arr.values)))
                        lengths.append(
                            np.stack(
                                [as_numpy(batch.column(c)) for c in ("prompt_len", "chosen_len", "rejected_len")],
                                axis=1,
                            )
                        )
                        sources.append(remap[as_numpy(batch.column("source_id"))])
                        batch_of.append(np.full(batch.num_rows, k, dtype=np.int32))
                        row_of.append(np.arange(batch.num_rows, dtype=np.int32))
                        self._located.append((d, shard["path"]))
                        if self.vision:  # memory-mapped too: an image's bytes are read when its pair is packed
                            self._images.append((batch.column("image_bytes"), batch.column("image_sha256")))
                except (pa.ArrowException, KeyError, IndexError, ValueError) as e:
                    raise DataError(
                        f"dataset {d}: shard {shard['path']} cannot be read ({type(e).__name__}: {e}); "
                        "run dpo-data verify on it"
                    ) from None
        all_lengths = np.concatenate(lengths)
        self.prompt_len, self.chosen_len, self.rejected_len = (
            np.ascontiguousarray(all_lengths[:, j]) for j in range(3)
        )
        self.source_id = np.concatenate(sources)
        self._parts = parts
        self._batch_of, self._row_of = np.concatenate(batch_of), np.concatenate(row_of)


def _batches(path: Path, rows: int) -> list[pa.RecordBatch]:
    try:
        reader = pa.ipc.open_file(pa.memory_map(str(path), "r"))
    except (OSError, pa.ArrowException) as e:
        raise DataError(f"{path}: cannot open the shard ({e}); run dpo-data verify on its dataset") from None
    batches = [reader.get_batch(i) for i in range(reader.num_record_batches)]
    if sum(b.num_rows for b in batches) != rows:
        raise DataError(
            f"{path}: holds {sum(b.num_rows for b in batches)} rows, its manifest says {rows}; "
            "run dpo-data verify on its dataset"
        )
    return batches


def _one_tokenizer(dirs: list[str], manifests: list[dict]) -> str:
    prints = {m["tokenizer"]["fingerprint"] for m in manifests}
    if len(prints) > 1:
        listing = ", ".join(
            f"{d}: {m['tokenizer']['fingerprint'][:15]} with {template_origin(recorded_chat_template(m))}"
            for d, m in zip(dirs, manifests)
        )
        first = manifests[0]["tokenizer"]
        other = next(m["tokenizer"] for m in manifests if m["tokenizer"]["fingerprint"] != first["fingerprint"])
        raise DataError(
            f"datasets built with different tokenizers cannot be mixed ({listing}; differing parts: "
            f"{', '.join(differing_parts(first, other))}); rebuild them with one tokenizer and one --chat-template "
            "(or none)"
        )
    return prints.pop()


def _one_processor(dirs: list[str], manifests: list[dict]) -> bool:
    """Whether the datasets hold images (built with dpo-data build --processor): all of them with one processor, or
    none. A mixture of vision and text datasets, or of two processors, is refused by name."""
    vision = [d for d, m in zip(dirs, manifests) if is_vision(m)]
    if not vision:
        return False
    if len(vision) < len(dirs):
        text = [d for d in dirs if d not in vision]
        raise DataError(
            f"datasets {', '.join(vision)} hold images (built with --processor) and {', '.join(text)} do not; a "
            "mixture is one kind: build the text pairs with the same --processor (rows without images are allowed)"
        )
    prints = {m["processor"]["fingerprint"] for m in manifests}
    if len(prints) > 1:
        listing = ", ".join(f"{d}: {m['processor']['fingerprint'][:15]}" for d, m in zip(dirs, manifests))
        raise DataError(
            f"datasets built with different processors cannot be mixed ({listing}); rebuild them with one --processor"
        )
    return True
