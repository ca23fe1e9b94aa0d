"""`dpo-data build --processor`: vision rows tokenized exactly as the processor does, images stored and hashed in the
shards, the processor attested, verified and inspected, in parts and merged; text datasets unchanged."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import orjson
import pyarrow as pa
import pytest

from dpo_data.dataset.manifest import manifest_problems, read_manifest
from dpo_data.dataset.shards import SHARD_SCHEMA, VISION_SHARD_SCHEMA, open_shard
from dpo_data.prepare.build import BuildOptions, build
from tests.harness import data_cli, data_here
from tests.vision.conftest import FAMILIES
from tests.vision.tiny_vlm import load_processor
from tests.vision.vision_data import pil, trl_ids, vision_inputs

ROWS = 9  # vision_inputs: 6 JSON lines, 2 Parquet rows, 1 save_to_disk row


@pytest.fixture(scope="module")
def inputs(tmp_path_factory, images) -> list[Path]:
    return vision_inputs(tmp_path_factory.mktemp("vision-inputs"), images)


@pytest.fixture(scope="module")
def built(inputs, vlm_dirs, tmp_path_factory) -> dict[str, Path]:
    """Each family's dataset of `inputs`, built in this process."""
    found = {}
    for family in sorted(FAMILIES):
        out = tmp_path_factory.mktemp(family) / "ds"
        result = build(list(map(str, inputs)), None, out, BuildOptions(pairs_per_shard=4), str(vlm_dirs[family]))
        assert result.error is None and result.rejects_by_reason == {}, result.rejects_by_reason
        found[family] = out
    return found


def raw_rows(inputs: list[Path]) -> list[dict]:
    """The rows as TRL would read them: JSON lines, the Parquet rows, the save_to_disk rows."""
    import pyarrow.parquet as pq

    rows = [orjson.loads(line) for line in inputs[0].read_bytes().splitlines()]
    rows += pq.read_table(inputs[1]).to_pylist()
    arrow = next(inputs[2].glob("*.arrow"))
    rows += pa.ipc.open_stream(pa.memory_map(str(arrow))).read_all().to_pylist()
    return rows


def table(out: Path) -> list[dict]:
    return [r for shard in sorted((out / "shards").iterdir()) for r in open_shard(shard).to_pylist()]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ids_equal_the_processors_and_images_are_stored_as_given(family, built, inputs, vlm_dirs, images):
    """Every pair's prompt ids are `processor(text=prompt, images=...)`'s and prompt + completion the processor's ids
    of the full rendering, as TRL 1.16 makes them (its own prepare_multimodal_messages and chat template call); each
    image's original bytes are stored, in placeholder order, with their sha256."""
    processor = load_processor(vlm_dirs[family])
    pairs, rows = table(built[family]), raw_rows(inputs)
    assert len(pairs) == len(rows) == ROWS
    stored_in_order = [images[0], images[1], images[2], images[2], images[3], images[1], images[3], images[0]]
    stored_in_order += [images[3], images[1], images[2]]
    assert [b for pair in pairs for b in pair["image_bytes"]] == stored_in_order
    for pair, raw in zip(pairs, rows):
        assert pair["image_sha256"] == [hashlib.sha256(b).hexdigest() for b in pair["image_bytes"]]
        prompt, full_chosen, full_rejected = trl_ids(processor, raw, [pil(b) for b in pair["image_bytes"]])
        assert pair["prompt_ids"] == prompt
        assert pair["prompt_ids"] + pair["chosen_ids"] == full_chosen
        assert pair["prompt_ids"] + pair["rejected_ids"] == full_rejected
        image_tokens = pair["prompt_ids"].count(read_manifest(built[family])["processor"]["image_token_id"])
        assert (image_tokens > 0) == bool(pair["image_bytes"])  # placeholders expanded, one token or more an image


def test_the_manifest_records_processor_images_and_options(built, images):
    for out in built.values():
        m = read_manifest(out)
        stored = 2 * len(images[0]) + 3 * sum(map(len, images[1:]))  # image 0 is in 2 pairs, the others in 3
        assert m["images"] == {"count": 11, "bytes": stored, "pairs": 8, "max_per_pair": 2}
        assert m["producer"]["options"]["max_image_pixels"] == 1 << 25
        assert m["processor"]["fingerprint"].startswith("p1:") and manifest_problems(m) == []
        assert open_shard(out / m["shards"][0]["path"]).schema == VISION_SHARD_SCHEMA
    assert read_manifest(built["idefics3"])["processor"]["processor_class"] == "Idefics3Processor"
    assert read_manifest(built["qwen2_5_vl"])["processor"]["image_token"] == "<|image_pad|>"


def test_a_text_dataset_keeps_its_shard_schema_and_records_nothing_of_images(sample_dataset):
    m = read_manifest(sample_dataset)
    assert not {"processor", "images"} & set(m) and "max_image_pixels" not in m["producer"]["options"]
    assert open_shard(sample_dataset / m["shards"][0]["path"]).schema == SHARD_SCHEMA


def test_the_fingerprint_covers_every_images_bytes(built, inputs, vlm_dirs, tmp_path, images):
    """One image's bytes changed (one pixel, re-encoded) and the same rows built again: another fingerprint, though
    the ids are the same (the image keeps its size)."""
    from PIL import Image

    copy = tmp_path / "inputs"
    shutil.copytree(inputs[0].parent, copy)
    picture = Image.open(copy / "img/0.png").convert("RGB")
    picture.putpixel((0, 0), tuple(255 - c for c in picture.getpixel((0, 0))))
    picture.save(copy / "img/0.png")
    out = tmp_path / "ds"
    options = BuildOptions(pairs_per_shard=4)
    build([str(copy / "files.jsonl"), str(copy / "binary.parquet"), str(copy / "hub")], None, out, options,
          str(vlm_dirs["qwen2_5_vl"]))  # fmt: skip
    before, after = table(built["qwen2_5_vl"]), table(out)
    assert [p["prompt_ids"] for p in before] == [p["prompt_ids"] for p in after]
    assert read_manifest(out)["fingerprint"] != read_manifest(built["qwen2_5_vl"])["fingerprint"]


def test_the_cli_builds_verifies_and_inspects_a_vision_dataset(inputs, qwen25vl, tmp_path, run_cli):
    """The CLI, in a process of its own: build, verify against the processor, inspect."""
    out = tmp_path / "ds"
    done = data_cli("build", *inputs, "--processor", qwen25vl, "--out", out, "--pairs-per-shard", 4)
    assert f"read {ROWS} rows: kept {ROWS} pairs, rejected 0" in done.stdout
    assert "images: 11 in 8 pairs" in done.stdout
    verified = data_cli("verify", out, "--processor", qwen25vl)
    assert verified.stdout == f"OK: {out} verified (processor attested)\n"  # was "(tokenizer attested)"
    assert data_here(run_cli, "verify", out, "--tokenizer", qwen25vl).stdout == verified.stdout  # the same check
    shown = data_cli("inspect", out).stdout
    assert "images       11 in 8 pairs (at most 2 a pair)" in shown
    assert f"processor    {read_manifest(out)['processor']['fingerprint']}" in shown
    info = json.loads(data_cli("inspect", out, "--json").stdout)
    assert info["images"]["count"] == 11


def tamper_image(shard: Path, image: bytes) -> None:
    """Flip one byte in the middle of the first copy of an image's bytes in the shard file."""
    data = bytearray(shard.read_bytes())
    at = data.find(image)
    assert at >= 0
    data[at + len(image) // 2] ^= 0x01
    shard.write_bytes(bytes(data))


def test_verify_names_the_pair_whose_image_bytes_changed(built, tmp_path, images, run_cli):
    out = tmp_path / "ds"
    shutil.copytree(built["qwen2_5_vl"], out)
    m = read_manifest(out)
    shard = out / m["shards"][0]["path"]
    tamper_image(shard, images[0])
    failed = data_here(run_cli, "verify", out, code=1).stderr
    assert f"{m['shards'][0]['path']}: sha256" in failed  # the shard's hash
    assert "pair 0 (row 0: " in failed and "files.jsonl line 1)" in failed
    assert "the bytes of image 0 do not match their image_sha256 (changed)" in failed


def test_the_per_image_hash_catches_a_change_the_shard_hash_was_updated_for(built, tmp_path, images, run_cli):
    """A shard whose recorded sha256, size and the dataset fingerprint were rewritten to match the tampered bytes
    (what an edit that means to pass would do): the image's own sha256 still names the pair."""
    from dpo_data.dataset.manifest import dataset_fingerprint
    from dpo_state.digest import file_digest

    out = tmp_path / "ds"
    shutil.copytree(built["idefics3"], out)
    m = read_manifest(out)
    shard = out / m["shards"][0]["path"]
    tamper_image(shard, images[1])
    m["shards"][0].update(sha256=file_digest(shard), bytes=shard.stat().st_size)
    m["fingerprint"] = dataset_fingerprint(
        m["tokenizer"]["fingerprint"], m["sources"], m["shards"], None, m["processor"]["fingerprint"]
    )
    (out / "manifest.json").write_bytes(orjson.dumps(m))
    failed = data_here(run_cli, "verify", out, code=1).stderr
    assert "(1 problems)" in failed
    assert "pair 1 (row 1: " in failed and "the bytes of image 0 do not match their image_sha256" in failed


def edited_copy(source: Path, target: Path, name: str, edit) -> Path:
    shutil.copytree(source, target, ignore=shutil.ignore_patterns("*.safetensors"))
    document = json.loads((target / name).read_text())
    edit(document)
    (target / name).write_text(json.dumps(document))
    return target


def test_the_processor_attestation_is_portable_and_names_what_changed(built, vlm_dirs, tmp_path, run_cli):
    from dpo_data.processor import load_processor as load
    from dpo_data.processor import rendering_tokenizer
    from dpo_state.attestation import processor_attestation, tokenizer_attestation

    def attest(directory):
        processor = load(directory)
        return processor_attestation(processor, tokenizer_attestation(rendering_tokenizer(processor)))

    idefics = vlm_dirs["idefics3"]
    moved = shutil.copytree(idefics, tmp_path / "elsewhere" / "model", ignore=shutil.ignore_patterns("*.safetensors"))
    assert attest(moved) == attest(idefics) == read_manifest(built["idefics3"])["processor"]
    data_here(run_cli, "verify", built["idefics3"], "--processor", moved)

    def bigger(document):
        document["image_processor"]["max_image_size"]["longest_edge"] = 64

    def longer(document):
        document["image_seq_len"] = 9

    for name, edit, part in (("bigger", bigger, "image_processor"), ("longer", longer, "processor")):
        changed = edited_copy(idefics, tmp_path / name, "processor_config.json", edit)
        failed = data_here(run_cli, "verify", built["idefics3"], "--processor", changed, code=1).stderr
        assert f"processor {changed} has fingerprint p1:" in failed and f"(differing parts: {part})" in failed
    template = edited_copy(idefics, tmp_path / "template", "processor_config.json", lambda d: None)
    (template / "chat_template.jinja").write_text((idefics / "chat_template.jinja").read_text() + " ")
    failed = data_here(run_cli, "verify", built["idefics3"], "--tokenizer", template, code=1).stderr
    assert "(differing parts: tokenizer)" in failed and "(differing parts: chat_template)" in failed


def test_a_vision_build_in_parts_merges_to_the_single_builds_bytes(inputs, qwen25vl, built, tmp_path, run_cli):
    """--part 0/2 and 1/2 (spans of 4 rows: 3 spans), then merge: the single build's manifest and shard bytes.
    --num-proc 2 (forked workers, each with the processor) writes them too."""
    args = [*inputs, "--processor", qwen25vl, "--pairs-per-shard", 4]
    for k in range(2):
        data_here(run_cli, "build", *args, "--out", tmp_path / f"part{k}", "--part", f"{k}/2")
    merged = tmp_path / "merged"
    data_here(run_cli, "merge", tmp_path / "part0", tmp_path / "part1", "--out", merged)
    forked = tmp_path / "forked"
    data_cli("build", *args, "--out", forked, "--num-proc", 2)
    single = built["qwen2_5_vl"]
    for other in (merged, forked):
        assert read_manifest(other) == read_manifest(single)
        for shard in read_manifest(single)["shards"]:
            assert (other / shard["path"]).read_bytes() == (single / shard["path"]).read_bytes()
    data_here(run_cli, "verify", merged, "--processor", qwen25vl)


def test_a_part_of_another_processor_does_not_merge(inputs, vlm_dirs, tmp_path, run_cli):
    for k, family in enumerate(sorted(FAMILIES)):
        data_here(run_cli, "build", *inputs, "--processor", vlm_dirs[family], "--pairs-per-shard", 4,
                 "--out", tmp_path / f"part{k}", "--part", f"{k}/2")  # fmt: skip
    refused = data_here(
        run_cli, "merge", tmp_path / "part0", tmp_path / "part1", "--out", tmp_path / "m", code=2
    ).stderr
    assert "is part of another build" in refused and "tokenizer, processor" in refused


def test_an_edited_processor_attestation_contradicts_the_manifest(built):
    m = read_manifest(built["qwen2_5_vl"])
    edited = json.loads(json.dumps(m))
    edited["processor"]["components"]["image_processor"] = "0" * 64
    assert any("processor fingerprint" in p and "was edited" in p for p in manifest_problems(edited))
    edited = json.loads(json.dumps(m))
    edited["images"]["count"] += 1  # the manifest alone cannot tell: verify recounts from the shards
    del edited["images"]
    assert any("without the rest of processor, images" in p for p in manifest_problems(edited))
