"""Vision datasets for the tests: a few rows with real PNG/JPEG files beside them, built by `dpo-data build
--processor` (the library call) against a family's tiny VLM directory."""

from __future__ import annotations

import json
from pathlib import Path

from tests.vision.pairs import ROWS
from tests.vision.tiny_vlm import IMAGES, sample_images


def write_rows(folder: Path) -> Path:
    """`rows.jsonl` in `folder` (TRL's vision shape: `images` paths relative to the file, image parts in the
    prompt) and its image files: ROWS (0, 1 and 2 images a prompt), each twice with the images in another order
    so that pairs differ only by their pixels."""
    folder.mkdir(parents=True, exist_ok=True)
    names = []
    for spec, data in zip(IMAGES, sample_images()):
        names.append(f"image-{spec['index']}.{spec['fmt'].lower()}")
        (folder / names[-1]).write_bytes(data)
    rows = []
    for turn in range(2):
        for picks, question, chosen, rejected in ROWS:
            picks = picks[::-1] if turn else picks
            content = [{"type": "image"} for _ in picks] + [{"type": "text", "text": question}]
            rows.append(
                {
                    "id": f"{turn}-{len(rows)}",
                    "images": [names[i] for i in picks],
                    "prompt": [{"role": "user", "content": content}],
                    "chosen": [{"role": "assistant", "content": chosen}],
                    "rejected": [{"role": "assistant", "content": rejected}],
                }
            )
    path = folder / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def build_vision(model_dir: Path, out: Path, **options) -> Path:
    """The rows of `write_rows` built with `model_dir`'s processor into `out` (a committed dataset)."""
    from dpo_data.prepare.build import BuildOptions, build

    rows = write_rows(out.parent / f"{out.name}-input")
    result = build([str(rows)], None, out, BuildOptions(**options), processor_dir=str(model_dir))
    assert result.manifest is not None and result.manifest["totals"]["pairs"] == 2 * len(ROWS)
    return out
