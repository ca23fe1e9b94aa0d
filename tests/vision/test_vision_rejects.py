"""Hostile vision rows: every bad image or image count is a reject naming the row, the field, the value and the fix,
never a traceback nor a silent drop; a text build refuses images; a prompt with images is never truncated."""

from __future__ import annotations

import json

import pytest

from dpo_data.dataset.manifest import read_manifest
from dpo_data.dataset.shards import open_shard
from dpo_data.images import DEFAULT_MAX_IMAGE_PIXELS, pil_pixel_limit
from tests.data.test_build import VISION_REASONS
from tests.harness import data_here
from tests.vision.conftest import FAMILIES
from tests.vision.tiny_vlm import IMAGES, image_bytes
from tests.vision.vision_data import bomb_png, png_header, row, user, write_images, write_jsonl

IMAGE_TOKEN = {"qwen2_5_vl": "<|image_pad|>", "idefics3": "<image>"}


def bad_rows(names: list[str], token: str) -> list[tuple[str, dict, str]]:
    """(reason, row, what its message must say). Files: the sample images; garbage.png, truncated.jpg, huge.png (a
    6000 x 6000 header: over the default pixel cap), max.png (an 8192 x 4096 header: at the cap), warn.png (10000 x
    10000: PIL's bomb warning), bomb.png (a real 20000 x 20000 PNG of 50 KB: PIL's DecompressionBombError)."""

    def one(image, text: str = "What is it?") -> dict:
        return row(user(None, text), "This.", "That.", [image])

    image_in_completion = row(user(None, "x"), "y", "z", [names[0]])
    image_in_completion["chosen"] = [{"role": "assistant", "content": [{"type": "image"}]}]
    return [
        ("image_unreadable", one("img/garbage.png"), "images[0] ('img/garbage.png'): 4096 bytes that PIL does not"),
        ("image_unreadable", one("img/truncated.jpg"), "PIL cannot decode its pixels"),
        ("image_missing", one("img/absent.png"), "images[0] is 'img/absent.png', but "),
        ("image_path_outside", one("../outside.png"), "which lies outside the input's directory"),
        ("image_path_outside", one("/etc/hostname"), "images[0] is '/etc/hostname', which lies outside"),
        ("image_too_large", one("img/huge.png"), "6000 x 6000 = 36000000 pixels, over --max-image-pixels 33554432"),
        (
            "row_images_too_large",
            row(user(None, "Five?"), "Yes.", "No.", ["img/max.png"] * 5),
            "the row: its images declare 167772160 pixels together by images[4] (5 images",
        ),
        ("image_bomb", one("img/warn.png"), "PIL flags it as a decompression bomb"),
        ("image_bomb", one("img/bomb.png"), "PIL flags it as a decompression bomb"),
        ("image_count_mismatch", row(user(None, "Two?", None), "Yes.", "No.", names[:1]), "the prompt holds 2 image"),
        ("image_count_mismatch", row(user("Parts, none an image"), "Yes.", "No.", names[:2]), "the prompt holds 0"),
        ("control_text_in_vision_content", one(names[0], f"Look: {token}"), f"the special-token text {token!r}"),
        ("wrong_type", image_in_completion, "chosen[0] holds an image part; completions are text"),
        (
            "wrong_type",
            {"prompt": "plain text", "chosen": "a", "rejected": "b", "images": [names[0]]},
            "field 'images' holds 1 images, but the prompt is plain text",
        ),
        ("wrong_type", one(17), "images[0] is 17; an image is a file path relative to the input file"),
    ]


@pytest.fixture(scope="module")
def hostile(tmp_path_factory, images):
    d = tmp_path_factory.mktemp("hostile")
    names = write_images(d, images)
    (d / "img/garbage.png").write_bytes(bytes(range(256)) * 16)
    jpeg = image_bytes(**IMAGES[1])
    (d / "img/truncated.jpg").write_bytes(jpeg[: len(jpeg) // 2])
    (d / "img/huge.png").write_bytes(png_header(6000, 6000))
    (d / "img/max.png").write_bytes(png_header(8192, 4096))  # at --max-image-pixels: five are over the row's bound
    (d / "img/warn.png").write_bytes(png_header(10_000, 10_000))
    (d / "img/bomb.png").write_bytes(bomb_png())
    (d.parent / "outside.png").write_bytes(images[0])  # readable, but not the input's to take
    return d, names


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_each_bad_row_is_a_named_reject_and_the_good_rows_are_kept(family, hostile, vlm_dirs, tmp_path, run_cli):
    d, names = hostile
    cases = bad_rows(names, IMAGE_TOKEN[family])
    good = row(user(None, "Fine?"), "Yes.", "No.", [names[0]])
    write_jsonl(d / f"{family}.jsonl", [case for _, case, _ in cases] + [good])
    out = tmp_path / "ds"
    done = data_here(run_cli, "build", d / f"{family}.jsonl", "--processor", vlm_dirs[family], "--out", out)
    assert f"kept 1 pairs, rejected {len(cases)}" in done.stdout and "Traceback" not in done.stderr
    records = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in records] == [reason for reason, _, _ in cases]
    assert [r["line"] for r in records] == list(range(1, len(cases) + 1))
    for record, (_, _, said) in zip(records, cases):
        assert said in record["message"], (record["reason"], record["message"])
    assert set(VISION_REASONS) == {r["reason"] for r in records} - {"wrong_type"}
    assert read_manifest(out)["images"] == {"count": 1, "bytes": len((d / names[0]).read_bytes()), "pairs": 1,
                                            "max_per_pair": 1}  # fmt: skip


def test_a_text_build_refuses_rows_with_images_naming_the_fix(hostile, smollm2_dir, tmp_path, run_cli):
    d, names = hostile
    path = write_jsonl(d / "text.jsonl", [row(user("Hi"), "a", "b", []), row(user(None, "x"), "y", "z", names[:1])])
    refused = data_here(run_cli, "build", path, "--tokenizer", smollm2_dir, "--out", tmp_path / "ds", code=2).stderr
    assert f"{path} line 2 has 1 images, but the build was given a tokenizer (--tokenizer)" in refused
    assert "build vision data with --processor DIR" in refused and "Traceback" not in refused
    assert not (tmp_path / "ds").exists()


def test_a_text_tokenizer_as_processor_is_refused(hostile, smollm2_dir, tmp_path, run_cli):
    d, names = hostile
    path = write_jsonl(d / "one.jsonl", [row(user(None, "x"), "y", "z", names[:1])])
    refused = data_here(run_cli, "build", path, "--processor", smollm2_dir, "--out", tmp_path / "ds", code=2).stderr
    assert "holds no image processor" in refused and "build text-only data with --tokenizer" in refused
    both = data_here(run_cli, "build", path, "--processor", smollm2_dir, "--tokenizer", smollm2_dir,
                     "--out", tmp_path / "x", code=2).stderr  # fmt: skip
    assert "give exactly one of --tokenizer DIR (text data) and --processor DIR" in both


def test_a_prompt_with_images_is_never_truncated(hostile, qwen25vl, tmp_path, run_cli):
    """At --max-length one short of a pair with an image, --overlength truncate-prompt rejects it (naming its image
    tokens) where it truncates a text-only conversation of the same length; at its length it is kept."""
    d, names = hostile
    with_image = row(user(None, "Describe the picture in detail."), "Noise.", "A cat.", names[:1])
    without = row(user("Describe a picture of noise in detail, please, " * 3), "Noise.", "A cat.")
    path = write_jsonl(d / "long.jsonl", [with_image, without])
    out = tmp_path / "exact"
    data_here(run_cli, "build", path, "--processor", qwen25vl, "--out", out)
    first, second = open_shard(out / read_manifest(out)["shards"][0]["path"]).to_pylist()
    length = len(first["prompt_ids"]) + max(len(first["chosen_ids"]), len(first["rejected_ids"]))
    assert len(second["prompt_ids"]) > len(first["prompt_ids"])  # so at length - 1 the text row is over too
    short = tmp_path / "short"
    args = ["--processor", qwen25vl, "--overlength", "truncate-prompt"]
    data_here(run_cli, "build", path, *args, "--out", short, "--max-length", length - 1)
    records = [json.loads(line) for line in (short / "rejects.jsonl").read_text().splitlines()]
    assert [(r["reason"], r["line"]) for r in records] == [("too_long", 1)]
    assert "of them the expanded placeholders of its 1 images" in records[0]["message"]
    assert "a prompt with images is never truncated" in records[0]["message"]
    assert read_manifest(short)["totals"]["truncated_prompts"] == 1  # the text-only row was truncated
    data_here(run_cli, "build", path, *args, "--out", tmp_path / "fits", "--max-length", length)
    assert read_manifest(tmp_path / "fits")["totals"]["pairs"] == 2


def test_max_image_pixels_is_a_cap_recorded_and_bounded(hostile, qwen25vl, tmp_path, run_cli):
    d, names = hostile
    path = write_jsonl(d / "cap.jsonl", [row(user(None, "x"), "y", "z", [names[0]]), row(user("t"), "y", "z")])
    out = tmp_path / "ds"
    data_here(run_cli, "build", path, "--processor", qwen25vl, "--out", out, "--max-image-pixels", 56 * 56 - 1)
    record = json.loads((out / "rejects.jsonl").read_text())
    assert (
        record["reason"] == "image_too_large"
        and "56 x 56 = 3136 pixels, over --max-image-pixels 3135" in (record["message"])
    )
    assert read_manifest(out)["producer"]["options"]["max_image_pixels"] == 3135
    over = data_here(run_cli, "build", path, "--processor", qwen25vl, "--out", tmp_path / "x",
                     "--max-image-pixels", 10**9, code=2).stderr  # fmt: skip
    assert "--max-image-pixels is 1000000000; allowed: 1 to 89478485" in over
    # the default goes unchecked (a text build imports no PIL), so it must lie within PIL's threshold
    assert 1 <= DEFAULT_MAX_IMAGE_PIXELS <= pil_pixel_limit()
