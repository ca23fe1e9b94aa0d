"""The loader delivers a vision dataset's micro-batches with their images: each pair's own pixels, as its processor
makes them from the original files, packed as `pack_vision` packs them, exactly resumable, tampering caught."""

from __future__ import annotations

import io
import shutil

import numpy as np
import pyarrow as pa
import pytest
import torch
from PIL import Image

from dpo_data import DPOLoader, LoaderConfig, contract_problems
from dpo_data.dataset.store import PairStore
from dpo_data.errors import DataError
from dpo_data.loading.microbatch import MicroBatch
from dpo_data.loading.vision import FAMILIES, VisionPair, pack_vision
from tests.vision.pairs import ROWS
from tests.vision.tiny_vlm import load_processor, sample_images

LAYOUTS = ("separate", "shared_prompt")


def config(layout: str = "separate", **more) -> LoaderConfig:
    return LoaderConfig(**{"pairs_per_step": 4, "max_tokens_per_microbatch": 400, "layout": layout, **more})


def truth_pair(processor, model_type: str, store: PairStore, index: int) -> VisionPair:
    """Pair `index` as the family's processor makes it from the original rows and image files (tests.vision.datasets:
    ROWS twice, the second time with each prompt's images reversed): its prompt's ids, which must be the stored
    ones, and its images."""
    turn, k = divmod(index, len(ROWS))
    picks, question = ROWS[k][0][:: -1 if turn else 1], ROWS[k][1]
    content = [{"type": "image"} for _ in picks] + [{"type": "text", "text": question}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    pictures = [Image.open(io.BytesIO(sample_images()[i])) for i in picks]
    got = processor(text=[text], images=[pictures] if pictures else None, return_tensors="pt")
    ids = store.pair(index)
    assert got["input_ids"][0].tolist() == ids.prompt.tolist(), f"pair {index}: the stored prompt ids differ"
    family = FAMILIES[model_type]
    images = {key: got[key] if family.rope else got[key][0] for key in family.image_keys} if pictures else {}
    return VisionPair(ids, images)


def assert_same(got: dict, want: dict) -> None:
    """Every key of two micro-batches equal, tensors bitwise."""
    assert set(got) == set(want), set(got) ^ set(want)
    for key, value in want.items():
        if torch.is_tensor(value):
            assert value.dtype == got[key].dtype and torch.equal(got[key], value), key
        else:
            assert got[key] == value, key


def batches(loader, n: int | None = None) -> list[dict]:
    out = []
    for batch in loader:
        out.append(batch)
        if n is not None and len(out) == n:
            break
    return out


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_microbatch_carries_its_pairs_own_images(family, layout, vlm_dirs, vision_datasets):
    """A whole epoch: every micro-batch equals `pack_vision` of its pairs with the images the processor makes from
    the original files (pixel values, grids or crop masks, 3D positions, segment_images), in the order the
    loader packed them, and meets the micro-batch contract; the expanded image tokens count as input tokens."""
    model_dir, data = vlm_dirs[family], vision_datasets[family]
    processor, model_config = load_processor(model_dir), _config(model_dir)
    store = PairStore([data])
    seen = []
    for batch in DPOLoader([data], config(layout), max_epochs=1, pad_to_multiple_of=8, processor=model_dir):
        assert contract_problems(batch) == []
        pairs = [truth_pair(processor, family, store, int(i)) for i in batch["pair_index"]]
        want = pack_vision(pairs, model_config, layout, pad_to_multiple_of=8)
        assert_same({k: batch[k] for k in want}, want)
        assert batch["num_input_tokens"] == int(store.segment_tokens(batch["pair_index"].numpy(), layout).sum())
        seen += batch["pair_index"].tolist()
    assert sorted(seen) == list(range(store.num_pairs))
    assert any(int(b) for b in store.segment_tokens(np.arange(store.num_pairs), layout))


def test_the_optional_microbatch_keys_are_the_layouts_and_the_images(vlm_dirs, vision_datasets):
    """`MicroBatch` defines no key the loader never yields: over both families and both layouts, vision micro-batches
    hold every required key, and the keys beyond them are exactly its optional ones (text rows:
    tests/data/test_loader.py)."""
    required, optional, extra = MicroBatch.__required_keys__, MicroBatch.__optional_keys__, set()
    for family in sorted(FAMILIES):
        for layout in LAYOUTS:
            loader = DPOLoader([vision_datasets[family]], config(layout), max_epochs=1, processor=vlm_dirs[family])
            for batch in loader:
                assert required <= set(batch), f"the loader yields no {required - set(batch)}"
                extra |= set(batch) - required
    assert extra - optional == set(), "the loader yields keys MicroBatch lacks"
    assert optional - extra == set(), "MicroBatch defines keys the loader never yields"


def _config(model_dir):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir)


@pytest.mark.parametrize(("family", "workers"), [("qwen2_5_vl", 1), ("idefics3", 0)])
def test_a_resumed_loader_yields_the_same_pixels(family, workers, vlm_dirs, vision_datasets):
    """Iterate, save, rebuild, load, compare the next micro-batches with the uninterrupted run's (built in this
    process), pixels bitwise, over an epoch's end; Qwen2.5-VL's interrupted and resumed loaders build theirs in a
    worker process, which loads the processor itself."""
    model_dir, data = vlm_dirs[family], vision_datasets[family]
    geometry = config("shared_prompt", num_workers=workers, pairs_per_step=2)
    whole = batches(DPOLoader([data], config("shared_prompt", pairs_per_step=2), max_epochs=2, processor=model_dir))
    first = DPOLoader([data], geometry, max_epochs=2, processor=model_dir)
    head = batches(first, 3)
    state = first.state_dict()
    resumed = DPOLoader([data], geometry, max_epochs=2, processor=model_dir)
    resumed.load_state_dict(state)
    tail = batches(resumed)
    assert len(head) + len(tail) == len(whole) and any(int(b["segment_images"].sum()) for b in tail)
    for got, want in zip(head + tail, whole):
        assert_same(got, want)


def _tampered_copy(data, tmp_path):
    """A copy of dataset `data` whose first image's bytes have one byte changed inside its shard (same length, the
    Arrow file still reads): the index of the pair it belongs to, and the copy."""
    copy = tmp_path / "tampered"
    shutil.copytree(data, copy)
    store = PairStore([copy])
    index = next(i for i in range(store.num_pairs) if store.images(i))
    image = store.images(index)[0][0]
    shard = copy / store.locate(index)[1]
    raw = shard.read_bytes()
    at = raw.index(image) + len(image) // 2
    shard.write_bytes(raw[:at] + bytes([raw[at] ^ 0x55]) + raw[at + 1 :])
    pa.ipc.open_file(pa.memory_map(str(shard))).read_all()  # still a readable Arrow file
    return index, copy, store.locate(index)[1]


@pytest.mark.parametrize("workers", [0, 1])
def test_a_changed_image_fails_closed_naming_the_pair(workers, vlm_dirs, vision_datasets, tmp_path):
    """One byte of one stored image changed after the build: the loader refuses it when it decodes that pair (in a
    worker too: the rank raises the message, not the worker's traceback), naming the pair and its shard."""
    model_dir = vlm_dirs["qwen2_5_vl"]
    index, copy, shard = _tampered_copy(vision_datasets["qwen2_5_vl"], tmp_path)
    loader = DPOLoader([copy], config(num_workers=workers), max_epochs=1, processor=model_dir)
    with pytest.raises(DataError) as e:
        batches(loader)
    said = str(e.value)
    assert f"pair {index} (dataset {copy}, {shard})" in said and "image_sha256" in said and "Traceback" not in said


def test_the_loader_refuses_another_processor_and_none(vlm_dirs, vision_datasets):
    data = vision_datasets["qwen2_5_vl"]
    with pytest.raises(DataError, match=r"hold images; .*processor=MODEL_DIR"):
        DPOLoader([data], config())
    with pytest.raises(
        DataError,
        match=r"the run.s processor .* has fingerprint p1:.*, the data was built with p1:.* \(differing parts: image",
    ):
        DPOLoader([data], config(), processor=vlm_dirs["idefics3"])


def test_the_contract_names_images_that_do_not_add_up(vlm_dirs, vision_datasets):
    """A row whose images were dropped, or whose images are not as many as its segments claim, breaks the
    contract; so does a padding segment holding images."""
    for family in sorted(FAMILIES):
        batch = batches(DPOLoader([vision_datasets[family]], config(), processor=vlm_dirs[family]), 1)[0]
        assert contract_problems(batch) == [] and int(batch["segment_images"].sum())
        dropped = {k: v for k, v in batch.items() if k != "pixel_values"}
        assert any("lacks" in p for p in contract_problems(dropped))
        fewer = dict(batch, segment_images=batch["segment_images"].clone())
        fewer["segment_images"][int(torch.nonzero(fewer["segment_images"])[0])] -= 1
        assert contract_problems(fewer), family
    no_counts = {k: v for k, v in batch.items() if k != "segment_images"}
    assert contract_problems(no_counts) == ["image_grid_thw, model_position_ids, pixel_values without segment_images"]
