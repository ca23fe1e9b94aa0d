"""Vision shards in bounded memory: a record batch ends at RECORD_BATCH_IMAGE_BYTES of images as well as at 1,024
rows (a pure function of the pairs, so --num-proc 2 and --part builds merged give the single build's bytes), the
build holds about one batch of images, and `verify` hashes the images a batch at a time."""

from __future__ import annotations

import random
import shutil
import tracemalloc
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from dpo_data.dataset import shards
from dpo_data.dataset.manifest import read_manifest
from dpo_data.dataset.shards import PairBlock, ShardWriter, open_shard
from dpo_data.dataset.verify import verify_dataset
from dpo_data.prepare.build import BuildOptions, build
from dpo_data.prepare.merge import merge
from dpo_data.prepare.parts import Part
from tests.vision.test_vision_build import tamper_image
from tests.vision.tiny_vlm import image_bytes
from tests.vision.vision_data import row, user, write_jsonl

BUDGET = 500_000
"""The record batches' image budget in these tests (the real one is 64 MiB): a few pairs a batch."""
ROWS, SPAN = 64, 32  # two shards
BIG_ROW = 5  # a pair whose three images are over BUDGET together


def pair_images(k: int, padded: bool = True) -> list[bytes]:
    """Row k's images: one small noise PNG with 200-280 KB after its end (PIL reads the pixels and stops: the bytes
    are large, the processor's work small), or for BIG_ROW three such (over BUDGET together); unpadded, the PNGs
    alone (the same pixels, 1/25 of the bytes)."""
    pad = 200_000 + 20_000 * (k % 5) if padded else 0
    if k == BIG_ROW:
        return [image_bytes(500 + j) + bytes(pad) for j in range(3)]
    return [image_bytes(100 + k) + bytes(pad)]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> dict[str, Path]:
    """pairs.jsonl, its images padded, and plain.jsonl, the same rows with unpadded images."""
    directory = tmp_path_factory.mktemp("bounded")
    (directory / "img").mkdir()
    found = {}
    for name, padded in (("pairs", True), ("plain", False)):
        rows = []
        for k in range(ROWS):
            names = []
            for j, data in enumerate(pair_images(k, padded)):
                names.append(f"img/{name}-{k}-{j}.png")
                (directory / names[-1]).write_bytes(data)
            rows.append(row(user(*[None] * len(names), f"Picture {k}?"), f"Noise {k}.", f"A cat {k}.", names))
        found[name] = write_jsonl(directory / f"{name}.jsonl", rows)
    return found


@pytest.fixture
def small_budget(monkeypatch):
    monkeypatch.setattr(shards, "RECORD_BATCH_IMAGE_BYTES", BUDGET)


def batch_sizes(shard: Path) -> list[tuple[int, int]]:
    """(pairs, image bytes) of each record batch of a shard file."""
    reader = pa.ipc.open_file(pa.memory_map(str(shard)))
    found = []
    for i in range(reader.num_record_batches):
        batch = reader.get_batch(i)
        sizes = [sum(map(len, images)) for images in batch.column("image_bytes").to_pylist()]
        found.append((batch.num_rows, sum(sizes)))
    return found


def vision_build(inputs: Path, qwen25vl, out: Path, **options) -> Path:
    result = build([str(inputs)], None, out, BuildOptions(pairs_per_shard=SPAN, **options), str(qwen25vl))
    assert result.error is None and result.rejects_by_reason == {}, result.rejects_by_reason
    return out


@pytest.fixture(scope="module")
def built(inputs, qwen25vl, tmp_path_factory) -> dict:
    """The dataset of pairs.jsonl built in this process with the small budget, and how far Python allocations rose
    while its rows were read, encoded and written: from the encoders' set-up (`init_worker`, which allocates more
    than that for a while) to the build's end (`_build_into`). A first build, of plain.jsonl, warms up imports
    and first calls, which allocate for good."""
    from dpo_data.prepare import build as module

    starts, rises, build_into, init_worker = [], [], module._build_into, module.init_worker

    def set_up(*args, **kwargs):
        init_worker(*args, **kwargs)
        starts.append(tracemalloc.get_traced_memory()[0])
        tracemalloc.reset_peak()

    def measured(*args, **kwargs):
        try:
            return build_into(*args, **kwargs)
        finally:
            rises.append(tracemalloc.get_traced_memory()[1] - starts[-1])

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shards, "RECORD_BATCH_IMAGE_BYTES", BUDGET)
        patch.setattr(module, "_build_into", measured)
        patch.setattr(module, "init_worker", set_up)
        tracemalloc.start()
        try:
            for k, name in enumerate(("plain", "pairs")):
                out = vision_build(inputs[name], qwen25vl, tmp_path_factory.mktemp(f"{name}{k}") / "ds")
        finally:
            tracemalloc.stop()
    return {"out": out, "rise": rises[-1]}


def test_batches_close_at_the_image_budget(built):
    """Every batch holds at most BUDGET of images, or one pair over it alone; each is as full as the budget allows
    (the next pair would not have fitted), and all the images are there."""
    out, total, batches = built["out"], 0, 0
    for shard in read_manifest(out)["shards"]:
        found = batch_sizes(out / shard["path"])
        table = open_shard(out / shard["path"])
        pairs = [sum(map(len, images)) for images in table.column("image_bytes").to_pylist()]
        start = 0
        for rows, size in found:
            assert size <= BUDGET or rows == 1, (shard["path"], found)
            if start + rows < len(pairs):  # not the shard's last batch: the next pair would not fit
                assert size + pairs[start + rows] > BUDGET, (shard["path"], found)
            start += rows
        assert start == len(pairs)
        total, batches = total + sum(size for _, size in found), batches + len(found)
    assert total == read_manifest(out)["images"]["bytes"] > 4 * BUDGET
    assert batches >= 8
    big = sum(map(len, pair_images(BIG_ROW)))
    assert big > BUDGET
    assert (1, big) in batch_sizes(out / read_manifest(out)["shards"][0]["path"])  # alone in its batch


def test_the_build_holds_about_one_batch_of_images(built):
    """The images cost the build far less than their total: a record batch (the budget), a chunk of
    VISION_CHUNK_ROWS rows and their copies, not every pair of a shard (half the total) as the record batches of
    1,024 rows held them."""
    total = read_manifest(built["out"])["images"]["bytes"]
    assert built["rise"] < total / 3, (built["rise"], total)
    print(f"images {total} bytes; the build's allocations rose {built['rise']} bytes")


def test_parts_and_num_proc_give_the_single_builds_bytes(built, inputs, qwen25vl, tmp_path, small_budget):
    """The budget cut is a pure function of the pairs: --num-proc 2 (other chunk arrival) and two parts merged write
    the single build's shards, byte for byte."""
    single = built["out"]
    forked = vision_build(inputs["pairs"], qwen25vl, tmp_path / "forked", num_proc=2)
    parts = []
    for k in range(2):
        parts.append(tmp_path / f"part{k}")
        vision_build(inputs["pairs"], qwen25vl, parts[-1], part=Part(k, 2))
    merged = tmp_path / "merged"
    merge([str(p) for p in parts], merged)
    for other in (forked, merged):
        assert read_manifest(other) == read_manifest(single)
        for shard in read_manifest(single)["shards"]:
            assert (other / shard["path"]).read_bytes() == (single / shard["path"]).read_bytes()


def test_verify_hashes_a_batch_at_a_time_and_names_the_changed_pair(built, tmp_path):
    """verify makes no Python object of the images (the old one held a whole shard's as bytes), and still names the
    pair whose image changed, in a later batch of the shard."""
    out = tmp_path / "ds"
    shutil.copytree(built["out"], out)
    total = read_manifest(out)["images"]["bytes"]
    tracemalloc.start()
    try:
        assert verify_dataset(out) == []
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < total / 4, (peak, total)
    print(f"images {total} bytes; verify peaked at {peak} bytes of Python allocations")
    m = read_manifest(out)
    k = 20  # pair 20 of the first shard: past its first batches
    assert batch_sizes(out / m["shards"][0]["path"])[0][0] < k
    tamper_image(out / m["shards"][0]["path"], pair_images(k)[0])
    failed = verify_dataset(out)
    assert f"{m['shards'][0]['path']} pair {k} (row {k}: " in "\n".join(failed)
    assert any("pairs.jsonl line 21): the bytes of image 0 do not match their image_sha256" in f for f in failed)


def blocks_of(n: int, seed: int) -> list[PairBlock]:
    """n pairs of 1-3 fake images (the writer does not decode them), pair 500's over BUDGET alone, cut into blocks of
    random sizes."""
    rng = random.Random(seed)
    images = [[bytes([k % 256]) * rng.randrange(1, 9_000) for _ in range(rng.randrange(1, 4))] for k in range(n)]
    images[500] = [b"x" * (BUDGET + 1)]
    blocks, start = [], 0
    while start < n:
        stop = min(n, start + rng.randrange(1, 40))
        m = stop - start
        blocks.append(
            PairBlock(
                source_id=np.zeros(m, np.int32),
                row_index=np.arange(start, stop, dtype=np.int64),
                input_index=np.zeros(m, np.int32),
                input_row=np.arange(start + 1, stop + 1, dtype=np.int64),
                lengths=np.ones((m, 3), np.int32),
                prompt=np.ones(m, np.int32),
                chosen=np.ones(m, np.int32),
                rejected=np.ones(m, np.int32),
                row_id=[None] * m,
                image_bytes=images[start:stop],
                image_sha256=[["0" * 64] * len(i) for i in images[start:stop]],
            )
        )
        start = stop
    return blocks


def written(directory: Path, blocks: list[PairBlock]) -> Path:
    writer = ShardWriter(directory, vision=True)
    for block in blocks:
        writer.add(block, ["s"] * len(block), span=0)
    (shard,) = writer.close()
    return directory / shard.path


def test_the_writer_cuts_whatever_blocks_arrive(tmp_path, small_budget, monkeypatch):
    """The same 1,100 pairs handed over in random blocks, as one pair then the rest, or as one block write the same
    bytes, in batches within the budget; with a budget no batch reaches, batches hold 1,024 rows as text shards do."""
    whole = PairBlock.concat(blocks_of(1100, seed=7))
    arrivals = {"random": blocks_of(1100, seed=7), "one then the rest": list(whole.split(1)), "whole": [whole]}
    files = {name: written(tmp_path / name.replace(" ", "-"), blocks) for name, blocks in arrivals.items()}
    assert len({path.read_bytes() for path in files.values()}) == 1
    found = batch_sizes(files["whole"])
    assert len(found) > 15 and all(size <= BUDGET or rows == 1 for rows, size in found)
    assert (1, BUDGET + 1) in found
    monkeypatch.setattr(shards, "RECORD_BATCH_IMAGE_BYTES", 1 << 40)
    assert [rows for rows, _ in batch_sizes(written(tmp_path / "rows", blocks_of(1100, seed=7)))] == [1024, 76]


def test_the_pool_keeps_at_most_its_window_of_chunks():
    """`_in_order` takes the results in order and never has more than `window` chunks sent and not yet taken
    (Pool.imap reads ahead and keeps every result that finishes early)."""
    from dpo_data.prepare.build import _in_order

    class Done:
        def __init__(self, value):
            self.value = value

        def get(self):
            return self.value

    class Pool:
        sent = 0

        def apply_async(self, function, args):
            self.sent += 1
            return Done(args[0])

    pool, taken, most = Pool(), 0, 0
    for result in _in_order(pool, iter(range(50)), window=4):
        assert result == taken
        taken += 1
        most = max(most, pool.sent - taken + 1)  # sent and not taken before this one
    assert taken == 50 and most == 4


def test_a_parquet_input_of_inline_images_is_read_a_slice_at_a_time(tmp_path, monkeypatch):
    """Rows holding image bytes come out as they are, but never more than ROWS_BYTES of them as Python objects at
    once (the old reader made a whole 1,024-row batch Python objects: every row here)."""
    import pyarrow.parquet as pq

    from dpo_data.prepare import inputs as module
    from dpo_data.prepare.inputs import iter_rows, open_input

    images = [bytes([k]) * 100_000 for k in range(40)]
    rows = [{"prompt": f"q{k}", "images": [data]} for k, data in enumerate(images)]
    path = tmp_path / "inline.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    monkeypatch.setattr(module, "ROWS_BYTES", 300_000)
    tracemalloc.start()
    try:
        found = []
        for number, row in iter_rows(open_input(str(path)), 1 << 20):
            found.append((number, row["prompt"], row["images"][0] == images[number - 1]))
            del row
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert found == [(k + 1, f"q{k}", True) for k in range(40)]
    assert peak < sum(map(len, images)) / 4, peak
