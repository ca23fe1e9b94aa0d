"""Hostile round 4 (issue 55), the parts landed so far: a tokenizer's saved truncation or padding never changes
the ids, and an image file decodes only as a raster format Pillow reads in-process (an EPS never runs
Ghostscript)."""

from __future__ import annotations

import io
import os
import re
import shutil
import stat
from pathlib import Path

import pytest

from dpo_data.dataset.store import PairStore
from dpo_data.prepare.build import BuildOptions, build
from tests.conftest import chat, write_jsonl

ROWS = [
    chat(
        "Please summarise the following paragraph in one sentence. " * (i + 1),
        f"A summary number {i}, short and to the point.",
        f"Summary {i}: it talks about many things at length.",
        system="You are a careful assistant.",
    )
    for i in range(4)
]


def _tokenizer_saving(tmp_path: Path, smollm2_dir: Path, name: str, change) -> Path:
    """SmolLM2's tokenizer directory with `change(Tokenizer)` saved into its tokenizer.json."""
    from tokenizers import Tokenizer

    out = tmp_path / name
    out.mkdir()
    for file in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(smollm2_dir / file, out / file)
    backend = Tokenizer.from_file(str(out / "tokenizer.json"))
    change(backend)
    backend.save(str(out / "tokenizer.json"))
    return out


def _ids(dataset: Path) -> list[tuple]:
    store = PairStore([str(dataset)])
    pairs = [store.pair(i) for i in range(store.num_pairs)]
    return [(p.prompt.tolist(), p.chosen.tolist(), p.rejected.tolist()) for p in pairs]


TEXT_ROWS = [
    {
        "prompt": f"Question {i}: " + "what is the sum of these numbers? " * (i + 2),
        "chosen": f"It is {i}.",
        "rejected": "No.",
    }
    for i in range(4)
]


@pytest.mark.parametrize("rows", [ROWS, TEXT_ROWS], ids=["chat", "text"])
@pytest.mark.parametrize(
    "name, change",
    [
        ("truncation", lambda t: t.enable_truncation(8)),
        ("left-truncation", lambda t: t.enable_truncation(8, direction="left")),
        ("padding", lambda t: t.enable_padding(length=256, pad_id=2, pad_token="<|im_end|>")),
    ],
)
def test_a_saved_truncation_or_padding_never_changes_the_ids(tmp_path, smollm2_dir, name, change, rows):
    """The build encoded with the backend itself, which applied a truncation or padding saved in tokenizer.json:
    a plain-text prompt cut to 8 tokens (or padded with pad ids) and built, a chat build refused as not
    prefix-stable, while the attestation (which leaves those settings out) called the tokenizer the clean one.
    Now the ids are the clean tokenizer's, whatever the file saved."""
    source = write_jsonl(tmp_path / "pairs.jsonl", rows)
    clean = build([str(source)], str(smollm2_dir), tmp_path / "clean", BuildOptions())
    saved = _tokenizer_saving(tmp_path, smollm2_dir, name, change)
    built = build([str(source)], str(saved), tmp_path / "saved", BuildOptions())
    assert built.error is None and clean.error is None, built.error
    assert _ids(tmp_path / "saved") == _ids(tmp_path / "clean")
    assert len(_ids(tmp_path / "clean")) == len(rows)
    assert min(len(prompt) for prompt, _, _ in _ids(tmp_path / "clean")) > 8  # the truncation would have cut


def _fake_ghostscript(tmp_path: Path, monkeypatch) -> Path:
    """A `gs` first on PATH that only leaves a mark: Pillow's EPS plugin runs `gs` to decode PostScript."""
    bin_dir, mark = tmp_path / "bin", tmp_path / "gs-ran"
    bin_dir.mkdir()
    gs = bin_dir / "gs"
    gs.write_text(f"#!/bin/sh\ntouch {mark}\nexit 1\n")
    gs.chmod(gs.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    from PIL import EpsImagePlugin

    monkeypatch.setattr(EpsImagePlugin, "gs_binary", None)  # looked up again, on this PATH
    return mark


EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\nnewpath 0 0 moveto 8 8 lineto stroke\nshowpage\n%%EOF\n"


def test_an_eps_image_is_never_handed_to_ghostscript(tmp_path, monkeypatch):
    """Image bytes decode only as PNG, JPEG, WebP, GIF, BMP or TIFF, in-process: a PostScript file is a named
    reject, and no external program runs (before, Pillow's EPS plugin ran `gs` on the dataset's own code)."""
    from PIL import Image

    from dpo_data.images import ImageError, decode_image

    mark = _fake_ghostscript(tmp_path, monkeypatch)
    with pytest.raises(ImageError) as caught:
        decode_image(EPS)
    assert not mark.exists(), "Ghostscript ran on the image's PostScript"
    assert caught.value.reason == "image_unreadable" and "PNG, JPEG" in caught.value.message
    for kind in ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF"):  # every listed format still decodes
        data = io.BytesIO()
        Image.new("RGB", (4, 3), (200, 10, 10)).save(data, format=kind)
        assert decode_image(data.getvalue()).size == (4, 3)


@pytest.mark.parametrize("name", ["img/loop.png", "img/nul\x00.png"])
def test_a_symlink_loop_or_a_nul_byte_in_an_image_path_is_a_row_reject(tmp_path, name):
    """Both killed the whole build with a traceback (RuntimeError, ValueError); now that row is rejected by name
    and the others build."""
    from dpo_data.prepare.inputs import InputFile
    from dpo_data.prepare.rows import Pair, RowReject
    from dpo_data.prepare.vision import read_images

    (tmp_path / "img").mkdir()
    (tmp_path / "img" / "loop.png").symlink_to(tmp_path / "img" / "loop.png")
    source = InputFile(str(tmp_path / "pairs.jsonl"), "jsonl", "pairs")
    pair = Pair("chat", [], [], [], None, None, images=[name])
    with pytest.raises(RowReject) as caught:
        read_images(pair, source, 1 << 20)
    assert caught.value.reason == "image_unreadable" and "cannot be resolved" in str(caught.value)


def test_the_commands_from_trl_prints_are_safe_to_paste():
    """A recipe's output_dir went into the printed `dpo-data build --out` and the `dpo-state push` repo unquoted:
    pasted, `x; touch pwned` ran. Every printed command now splits into the words it means."""
    import shlex

    from dpo_train.config.trl import translate

    hostile = "runs/x; touch pwned"
    _, notes = translate({"output_dir": hostile, "push_to_hub": True, "max_length": None})
    commands = [c for note in notes for c in re.findall(r"`([^`]*)`", note) if c.startswith(("dpo-data", "dpo-state"))]
    assert any(c.startswith("dpo-data build") for c in commands) and any(
        c.startswith("dpo-state push") for c in commands
    )
    for command in commands:
        words = shlex.split(command)
        assert "touch" not in words and ";" not in words, command
        assert any(hostile in word for word in words), command


def test_a_mixture_is_never_read_other_than_trl_reads_it():
    """A mixture entry's config was dropped (the printed build read the default configuration), and dataset_name
    beside dataset_mixture trained dataset_name, exit 0, where TRL trains the mixture: both are refused by name."""
    from dpo_train.config.trl import translate
    from dpo_train.errors import ConfigError

    mixture = {"datasets": [{"id": "me/prefs", "split": "train", "config": "hard"}]}
    with pytest.raises(ConfigError, match=r"dataset_mixture names me/prefs config 'hard'"):
        translate({"dataset_mixture": mixture})
    with pytest.raises(
        ConfigError, match=r"dataset_name is 'other/set' beside dataset_mixture: TRL trains the mixture"
    ):
        translate({"dataset_name": "other/set", "dataset_mixture": {"datasets": [{"id": "me/prefs"}]}})
    with pytest.raises(ConfigError, match=r"dpo-data build 'hf://datasets/me/prefs/data/train-\*'"):  # as before
        translate({"dataset_mixture": {"datasets": [{"id": "me/prefs", "config": None}]}})
