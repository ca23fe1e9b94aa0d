"""A vision dataset's stored images made model inputs in the loader's workers: checked, decoded, processed, packed."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from dpo_data.dataset.store import PairStore
from dpo_data.errors import DataError
from dpo_data.images import ImageError, decode_row, image_sha256
from dpo_data.loading.microbatch import PackedRow
from dpo_data.loading.vision import Family, VisionPair, pack_vision, vision_family


class ImageSource:
    """Where a vision store's images become the model's image inputs: the model directory `directory`, holding
    the model's config (config.json: image token, vision geometry, the rope rule) and the processor the datasets
    attest (their manifests' `processor`). Constructing it checks the processor against the attestation (fail
    closed, naming what differs); each process loads the two once (`_prepared`), so a loader worker pickles this
    as its few strings and loads them on its first micro-batch."""

    def __init__(self, directory: str | Path, store: PairStore):
        if not store.vision:
            raise DataError(f"datasets {', '.join(store.dirs)} hold no images: no processor is needed")
        self.directory = str(directory)
        self.attestation = store.processor_attestation
        self.template = store.chat_template
        self.max_pixels, self.max_row_pixels = store.max_image_pixels, store.max_row_image_pixels
        self.prepared  # noqa: B018 - loaded and checked here, on the rank, before any worker starts

    @property
    def prepared(self) -> tuple[Any, Any]:
        """(processor, model config), loaded once per process and checked against the datasets' attestation."""
        from dpo_state.attestation import attestation_mismatch

        template = self.template["text"] if self.template else None
        processor, config, actual = _loaded(self.directory, template)
        label = f"the run's processor ({self.directory})"
        mismatch = attestation_mismatch(self.attestation, actual, label, "the data")
        if mismatch:
            raise DataError(
                f"{mismatch}: their images would be prepared by another processor than the one their placeholders "
                "were expanded for. Fix: train with the model directory the data was built with (dpo-data build "
                "--processor), or rebuild the data with this one (`dpo-data verify DIR --tokenizer MODEL_DIR` "
                "compares them)"
            )
        return processor, config

    def pair(self, store: PairStore, index: int) -> VisionPair:
        """Pair `index` with its images as the processor outputs them for its prompt alone: each image's bytes
        checked against their recorded sha256 (a changed image fails closed, naming the pair), decoded as the
        build decoded them, and run through the attested processor."""
        processor, config = self.prepared
        stored = store.images(index)
        for k, (data, digest) in enumerate(stored):
            if image_sha256(data) != digest:
                raise DataError(
                    f"{_where(store, index)}: the bytes of its image {k} do not match their recorded image_sha256 "
                    f"({digest[:16]}...): the shard was changed after the build; refusing to train on it. Fix: "
                    "rebuild the dataset or restore the shard (`dpo-data verify DIR` names every changed image)"
                )
        try:  # the build's bounds, headers first: a row over the per-row bound is refused before any decode
            decoded = decode_row([data for data, _ in stored], self.max_pixels, self.max_row_pixels)
        except ImageError as e:
            which = "images" if e.index is None else f"image {e.index}"
            raise DataError(f"{_where(store, index)}: its {which} cannot be used ({e.reason}: {e.message})") from None
        pictures = [image for _, image in decoded]
        return VisionPair(store.pair(index), _processed(processor, vision_family(config), pictures))

    def pack(self, store: PairStore, indices: list[int], layout: str, pad_to_multiple_of: int | None) -> PackedRow:
        """The packed vision micro-batch of pairs `indices` (`pack_vision`), for the model of `directory`."""
        _, config = self.prepared
        return pack_vision([self.pair(store, i) for i in indices], config, layout, pad_to_multiple_of)

    def __getstate__(self) -> dict:
        return {k: self.__dict__[k] for k in ("directory", "attestation", "template", "max_pixels", "max_row_pixels")}


def _where(store: PairStore, index: int) -> str:
    dataset, shard = store.locate(index)
    return f"pair {index} (dataset {dataset}, {shard})"


def _processed(processor: Any, family: Family, pictures: list[Any]) -> dict[str, Any]:
    """The processor's image inputs for one prompt holding `pictures` (one batch row, its batch dimension dropped
    where the family has one: Idefics3's): the processor is called as the build called it, on a text of one
    placeholder a picture, so the pixels and geometry are those the prompt's expanded placeholders were made for."""
    if not pictures:
        return {}
    out = processor(text=[processor.image_token * len(pictures)], images=[pictures], return_tensors="pt")
    batched = not family.rope
    return {key: out[key][0] if batched else out[key] for key in family.image_keys if key in out}


@functools.lru_cache(maxsize=4)
def _loaded(directory: str, template: str | None) -> tuple[Any, Any, dict]:
    """The processor in `directory` (with the datasets' `--chat-template` where one was recorded), the model
    config there, and the processor's attestation; a DataError names what cannot be loaded."""
    from dpo_data.processor import load_processor, rendering_tokenizer
    from dpo_state.attestation import processor_attestation, tokenizer_attestation

    if not (Path(directory) / "config.json").is_file():
        raise DataError(
            f"the run's processor ({directory}): no config.json; vision data needs the model's directory (its config "
            "and its processor), as dpo-data build --processor was given it"
        )
    processor = load_processor(directory)
    tokenizer = rendering_tokenizer(processor)
    if template is not None:
        tokenizer.chat_template = template
    actual = processor_attestation(processor, tokenizer_attestation(tokenizer))
    from transformers import AutoConfig

    try:
        config = AutoConfig.from_pretrained(directory)
    except (OSError, ValueError) as e:
        raise DataError(f"the run's processor ({directory}): cannot read its config.json ({e})") from None
    vision_family(config)  # a family the loader cannot pack is named now
    return processor, config, actual
