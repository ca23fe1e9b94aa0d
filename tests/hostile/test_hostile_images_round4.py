"""Hostile round 4 (issue 55), images: a row's images are bounded together in decoded pixels before any is decoded
(a 0.6 KB row naming one PNG 40 times exhausted memory), and a binary image counts its bytes toward
--max-row-bytes, not its repr."""

from __future__ import annotations

import io
import json
import shutil
import sys
import textwrap

import numpy as np
import pytest
from PIL import Image

from dpo_data.dataset.manifest import MANIFEST_NAME, processor_problems, read_manifest
from dpo_data.dataset.store import PairStore
from dpo_data.errors import DataError
from dpo_data.images import DEFAULT_MAX_ROW_IMAGE_PIXELS
from tests.harness import data_here, run_process
from tests.vision.datasets import build_vision
from tests.vision.tiny_vlm import qwen25vl_dir, sample_images
from tests.vision.vision_data import row, user, write_jsonl

MIB = 1 << 20


@pytest.fixture(scope="module")
def qwen25vl(tmp_path_factory):
    """A tiny random Qwen2.5-VL's directory (tests/vision's, saved for this module)."""
    return qwen25vl_dir(tmp_path_factory.mktemp("qwen2_5_vl"))


def _png(image: Image.Image) -> bytes:
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def _rejects(out) -> list[dict]:
    return [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]


# -- a row's images bounded together, before any decode --------------------------------------------------

_MEASURE = textwrap.dedent(
    """
    import resource, sys
    from dpo_cli.data import main
    good, hostile, processor, warm, out = sys.argv[1:]
    main(["build", good, "--processor", processor, "--out", warm], standalone_mode=False)  # imports, processor
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    main(["build", hostile, "--processor", processor, "--out", out], standalone_mode=False)
    print("RSS_KIB", before, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
    """
)


def test_one_png_named_forty_times_is_a_row_reject_in_flat_memory(qwen25vl, tmp_path):
    """The issue's row: a 0.6 KB line naming one small PNG of 8192 x 4096 pixels (at --max-image-pixels) 40 times.
    Before, each name was decoded and all 40 held at once (32 MiB each here, as 8-bit grey); now the row's
    declared pixels are summed from the headers and it is rejected by name with nothing decoded: the build's peak
    RSS grows by less than 8 decoded copies over a build of the good row alone (what a second build costs)."""
    (tmp_path / "img").mkdir()
    (tmp_path / "img/big.png").write_bytes(_png(Image.new("L", (8192, 4096))))
    (tmp_path / "img/small.png").write_bytes(sample_images()[0])
    good = row(user(None, "Fine?"), "Yes.", "No.", ["img/small.png"])
    hostile = row([{"role": "user", "content": "Forty?"}], "Yes.", "No.", ["img/big.png"] * 40)
    assert len(json.dumps(hostile)) < 1024 and (tmp_path / "img/big.png").stat().st_size < 64 * 1024
    inputs = [write_jsonl(tmp_path / "good.jsonl", [good]), write_jsonl(tmp_path / "hostile.jsonl", [hostile, good])]
    out = tmp_path / "ds"
    proc = run_process([sys.executable, "-c", _MEASURE, *inputs, qwen25vl, tmp_path / "warm", out], timeout=180)
    before, after = map(int, proc.stdout.split("RSS_KIB")[1].split())
    # ru_maxrss is in KiB; a second build alone grows it by about 50 MiB here, 40 decoded copies by 1.3 GiB
    assert after - before < 8 * 32 * 1024, f"peak RSS grew by {(after - before) // 1024} MiB"
    (reject,) = _rejects(out)
    assert reject["line"] == 1 and reject["reason"] == "row_images_too_large", reject
    assert reject["message"].startswith(
        "the row: its images declare 167772160 pixels together by images[4] (5 images, every occurrence counted"
    )
    assert (
        f"over --max-row-image-pixels {DEFAULT_MAX_ROW_IMAGE_PIXELS}; no image of it was decoded" in (reject["message"])
    )
    manifest = read_manifest(out)
    assert manifest["totals"]["pairs"] == 1
    assert manifest["producer"]["options"]["max_row_image_pixels"] == DEFAULT_MAX_ROW_IMAGE_PIXELS


def test_a_repeated_image_is_read_and_decoded_once_per_row(tmp_path, monkeypatch):
    """Under the bound, a file named three times and the same bytes given inline are decoded once, the one
    decoded image shared (each occurrence still counted toward the row's pixels)."""
    from dpo_data import images
    from dpo_data.prepare.inputs import InputFile
    from dpo_data.prepare.rows import Pair, RowReject
    from dpo_data.prepare.vision import read_images

    data = sample_images()[0]
    (tmp_path / "a.png").write_bytes(data)
    loaded = []
    real = images.load_image
    monkeypatch.setattr(images, "load_image", lambda image: loaded.append(image) or real(image))
    pair = Pair("chat", [], [], [], None, None, images=["a.png", "a.png", data, "a.png"])
    found = read_images(pair, InputFile(str(tmp_path / "pairs.jsonl"), "jsonl", "pairs"), 1 << 20, 4 * 56 * 56)
    assert len(loaded) == 1 and all(f.image is found[0].image and f.data == data for f in found)
    with pytest.raises(RowReject, match=r"together by images\[3\] \(4 images") as caught:
        read_images(pair, InputFile(str(tmp_path / "pairs.jsonl"), "jsonl", "pairs"), 1 << 20, 4 * 56 * 56 - 1)
    assert caught.value.reason == "row_images_too_large" and len(loaded) == 1  # refused before any decode


def test_the_row_bound_is_an_option_of_vision_builds_only(qwen25vl, smollm2_dir, tmp_path, run_cli):
    """--max-row-image-pixels is recorded in a vision manifest and applied; given to a text build it is a usage
    error (exit 2) naming it, as --max-image-pixels is; below 1 it is refused."""
    (tmp_path / "img").mkdir()
    (tmp_path / "img/a.png").write_bytes(sample_images()[0])  # 56 x 56
    two, one = (row(user(*[None] * n, "How many?"), "Yes.", "No.", ["img/a.png"] * n) for n in (2, 1))
    path = write_jsonl(tmp_path / "rows.jsonl", [two, one])
    out = tmp_path / "ds"
    data_here(run_cli, "build", path, "--processor", qwen25vl, "--out", out, "--max-row-image-pixels", 2 * 3136 - 1)
    assert read_manifest(out)["producer"]["options"]["max_row_image_pixels"] == 2 * 3136 - 1
    (reject,) = _rejects(out)
    assert reject["line"] == 1 and reject["reason"] == "row_images_too_large"
    assert "over --max-row-image-pixels 6271" in reject["message"] and read_manifest(out)["totals"]["pairs"] == 1
    text = write_jsonl(tmp_path / "text.jsonl", [{"prompt": "Q", "chosen": " a", "rejected": " b"}])
    refused = data_here(run_cli, "build", text, "--tokenizer", smollm2_dir, "--out", tmp_path / "t",
                        "--max-row-image-pixels", DEFAULT_MAX_ROW_IMAGE_PIXELS, code=2).stderr  # fmt: skip
    assert f"error: --max-row-image-pixels {DEFAULT_MAX_ROW_IMAGE_PIXELS}: it applies only to a vision build" in (
        refused
    )
    zero = data_here(run_cli, "build", path, "--processor", qwen25vl, "--out", tmp_path / "z",
                     "--max-row-image-pixels", 0, code=2).stderr  # fmt: skip
    assert "--max-row-image-pixels is 0; it must be at least 1" in zero and "Traceback" not in zero


def _edited_copy(dataset, to, change) -> PairStore:
    shutil.copytree(dataset, to)
    manifest = json.loads((to / MANIFEST_NAME).read_text())
    change(manifest["producer"]["options"])
    (to / MANIFEST_NAME).write_text(json.dumps(manifest))
    return PairStore([str(to)])


def test_the_loader_applies_the_row_bound_its_datasets_record(qwen25vl, tmp_path):
    """The loader decodes through the same bound, read from the manifest: a dataset recording a smaller one than
    its first pair's two images (56 x 56 and 84 x 56) is refused at that pair by name, never decoded; a vision
    dataset built before the option (none recorded) is read under the default, and reads as before."""
    from dpo_data.loading.images import ImageSource

    dataset = build_vision(qwen25vl, tmp_path / "train")
    smaller = _edited_copy(dataset, tmp_path / "smaller", lambda o: o.update(max_row_image_pixels=3136 + 4704 - 1))
    source = ImageSource(qwen25vl, smaller)
    with pytest.raises(DataError, match=r"pair 0 \(dataset .*smaller.*\): its images cannot be used") as caught:
        source.pair(smaller, 0)
    assert "(row_images_too_large: its images declare 7840 pixels together" in str(caught.value)
    assert source.pair(smaller, 1).images  # one image of 4704 pixels: under it
    older = _edited_copy(dataset, tmp_path / "older", lambda o: o.pop("max_row_image_pixels"))
    assert processor_problems(read_manifest(tmp_path / "older")) == []
    assert older.max_row_image_pixels == DEFAULT_MAX_ROW_IMAGE_PIXELS
    assert ImageSource(qwen25vl, older).pair(older, 0).images


# -- binary images measured by their bytes ----------------------------------------------------------------


@pytest.fixture(scope="module")
def photo() -> bytes:
    """A real 2.4 MB PNG (900 x 900 of noise, which PNG cannot compress): a photo's size."""
    pixels = np.random.default_rng(0).integers(0, 256, size=(900, 900, 3), dtype=np.uint8)
    data = _png(Image.fromarray(pixels, "RGB"))
    assert 2_300_000 < len(data) < 2_600_000
    return data


def _hf_input(tmp_path, kind: str, photo: bytes):
    """The photo's row and a small image's, each image a `datasets` Image value ({"bytes", "path"} struct), written by
    `datasets` itself as Parquet or as a save_to_disk directory."""
    from datasets import Dataset, List
    from datasets import Image as HFImage

    rows = [
        {
            "images": [{"bytes": photo, "path": "photo.png"}],
            "prompt": [{"role": "user", "content": "What is in the photo?"}],
            "chosen": [{"role": "assistant", "content": "Noise."}],
            "rejected": [{"role": "assistant", "content": "A cat."}],
        },
        {
            "images": [{"bytes": sample_images()[0], "path": "small.png"}],
            "prompt": [{"role": "user", "content": "And this one?"}],
            "chosen": [{"role": "assistant", "content": "Noise too."}],
            "rejected": [{"role": "assistant", "content": "A dog."}],
        },
    ]
    dataset = Dataset.from_list(rows).cast_column("images", List(HFImage()))
    if kind == "parquet":
        dataset.to_parquet(str(tmp_path / "photo.parquet"))
        return tmp_path / "photo.parquet"
    dataset.save_to_disk(str(tmp_path / "saved"))
    return tmp_path / "saved"


@pytest.mark.parametrize("kind", ["parquet", "save_to_disk"])
def test_a_binary_image_counts_its_bytes_toward_max_row_bytes(photo, qwen25vl, tmp_path, run_cli, kind):
    """Before, a parsed row was measured by its JSON with bytes written as their repr (about 3.5 times their
    size): this 2.4 MB photo, which TRL trains, was rejected as row_too_large under the default 8 MiB. Now it is
    built; and under a --max-row-bytes its bytes do exceed, it is still rejected, naming its size."""
    source = _hf_input(tmp_path, kind, photo)
    out = tmp_path / "ds"
    data_here(run_cli, "build", source, "--processor", qwen25vl, "--out", out)
    manifest = read_manifest(out)
    assert manifest["totals"]["pairs"] == 2 and manifest["images"]["bytes"] == len(photo) + len(sample_images()[0])
    small = tmp_path / "small"
    data_here(run_cli, "build", source, "--processor", qwen25vl, "--out", small, "--max-row-bytes", 2 * MIB)
    (reject,) = _rejects(small)
    assert reject["row"] == 1 and reject["reason"] == "row_too_large"
    size = int(reject["message"].split("the row has ")[1].split()[0])
    assert len(photo) < size < len(photo) + 1024, reject["message"]  # the photo and a few hundred bytes of text
    assert f"over --max-row-bytes {2 * MIB}" in reject["message"]
