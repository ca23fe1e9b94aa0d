"""`dpo-data build` end to end on the real tokenizer: formats, rejects, accounting, determinism, refusals."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from dpo_cli.data import main as dpo_data
from dpo_data.dataset.manifest import manifest_problems, read_manifest
from dpo_data.dataset.shards import open_shard
from dpo_state.schema import schema_problems
from tests.conftest import chat, write_jsonl

A = lambda text: [{"role": "assistant", "content": text}]
U = lambda text: [{"role": "user", "content": text}]
CALL = {"type": "function", "function": {"name": "f", "arguments": {}}}

# One bad row per reason code that a row can earn (the tokenizer-dependent ones included).
BAD_ROWS = {
    "invalid_json": b'{"prompt": "Q", "chosen": ',
    "invalid_utf8": b'{"prompt": "Q\xff", "chosen": " a", "rejected": " b"}',
    "row_too_large": orjson.dumps({"prompt": "Q", "chosen": " " + "x" * 3000, "rejected": " b"}),
    "not_an_object": b"[1, 2, 3]",
    "missing_field": {"prompt": "Q", "chosen": " a"},
    "wrong_type": {"prompt": "Q", "chosen": 1, "rejected": " b"},
    "mixed_formats": {"prompt": "Q", "chosen": A("x"), "rejected": A("y")},
    "empty_prompt": {"prompt": "", "chosen": " a", "rejected": " b"},
    "empty_completion": {"prompt": "Q", "chosen": " ", "rejected": " b"},
    "identical_completions": {"prompt": "Q", "chosen": " a", "rejected": " a"},
    "unknown_role": {"prompt": [{"role": "robot", "content": "q"}], "chosen": A("x"), "rejected": A("y")},
    "roles_out_of_order": {"prompt": U("q") + U("q"), "chosen": A("x"), "rejected": A("y")},
    "history_diverges": {"chosen": U("q") + A("x") + U("r") + A("z"), "rejected": U("q") + A("y") + U("r") + A("z")},
    "prompt_not_prefix": {"prompt": "q", "chosen": U("other") + A("x"), "rejected": U("q") + A("y")},
    "no_implicit_prompt": {"chosen": "no turns here", "rejected": "no turns there"},
    "too_long": chat("word " * 300, "x", "y"),
    "completion_too_long": chat("q", "word " * 300, "y"),
    "tool_calls_not_rendered": {
        "prompt": U("q"),
        "chosen": [{"role": "assistant", "tool_calls": [CALL]}],
        "rejected": A("y"),
    },
    "tools_not_rendered": {**chat("q", "x", "y"), "tools": [CALL]},
    "control_text_outside_content": {**chat("q", "x", "y"), "tools": [{"description": "<|im_end|>"}]},
}
# these need a custom template: see test_tokenize.py and test_chat_template.py
TEMPLATE_REASONS = ("template_error", "template_budget", "template_not_prefix_stable")
# these need a processor and images: tests/vision/test_vision_build.py produces each one
VISION_REASONS = (
    "image_unreadable",
    "image_missing",
    "image_path_outside",
    "image_too_large",
    "row_images_too_large",
    "image_bomb",
    "image_count_mismatch",
    "control_text_in_vision_content",
)


def build(run_cli, tokenizer_dir, out, *inputs, extra=()):
    return run_cli(dpo_data, "build", *inputs, "--tokenizer", tokenizer_dir, "--out", out, *extra)


@pytest.fixture(scope="module")
def mixed_inputs(tmp_path_factory):
    """Good rows in every format, bad rows in a jsonl with a row per reason."""
    d = tmp_path_factory.mktemp("inputs")
    good = [chat(f"What is {i} + {i}?", f"{i} + {i} = {2 * i}.", f"{i} + {i} = {2 * i + 1}.") for i in range(30)]
    write_jsonl(d / "chat.jsonl", good[:10])
    c = zstandard.ZstdCompressor()
    lines = [
        orjson.dumps({"chosen": r["prompt"] + r["chosen"], "rejected": r["prompt"] + r["rejected"]}) + b"\n"
        for r in good[10:20]
    ]
    (d / "implicit.jsonl.zst").write_bytes(c.compress(b"".join(lines[:5])) + c.compress(b"".join(lines[5:])))
    text = [
        {"prompt": f"Q: capital {i}?\nA:", "chosen": f" City {i}.", "rejected": f" Town {i}.", "source": "geo"}
        for i in range(8)
    ]
    (d / "text.json").write_bytes(orjson.dumps(text))
    pq.write_table(pa.Table.from_pylist([{**r, "id": f"p{i}"} for i, r in enumerate(good[20:30])]), d / "multi.parquet")
    write_jsonl(d / "bad.jsonl", list(BAD_ROWS.values()) + [good[0]])
    return d


def files(d):
    return [d / "chat.jsonl", d / "implicit.jsonl.zst", d / "text.json", d / "multi.parquet", d / "bad.jsonl"]


@pytest.fixture(scope="module")
def built(mixed_inputs, smollm2_dir, tmp_path_factory):
    from click.testing import CliRunner

    out = tmp_path_factory.mktemp("built") / "ds"
    args = [
        *map(str, files(mixed_inputs)),
        "--tokenizer",
        str(smollm2_dir),
        "--out",
        str(out),
        "--max-length",
        "256",
        "--max-row-bytes",
        "2048",
        "--pairs-per-shard",
        "16",
    ]
    result = CliRunner().invoke(dpo_data, ["build", *args], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    return out, result


def test_every_row_is_kept_or_rejected_and_the_summary_says_so(built):
    out, result = built
    m = read_manifest(out)
    t = m["totals"]
    assert (t["rows_read"], t["pairs"], t["rejected"]) == (30 + 8 + len(BAD_ROWS) + 1, 39, len(BAD_ROWS))
    assert f"read {t['rows_read']} rows: kept 39 pairs, rejected {len(BAD_ROWS)}" in result.output
    for entry in m["inputs"]:
        assert entry["pairs"] + entry["rejected"] == entry["rows_read"]


def test_rejects_record_file_line_reason_and_raw_row(built, mixed_inputs):
    out, _ = built
    records = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert [r["reason"] for r in records] == list(BAD_ROWS)  # one per reason, in file order
    assert [r["line"] for r in records] == list(range(1, len(BAD_ROWS) + 1))
    for record in records:
        assert schema_problems("reject-record", record) == []
        assert record["file"] == str(mixed_inputs / "bad.jsonl") and record["source"] == "bad"
    assert records[0]["raw"] == '{"prompt": "Q", "chosen": '
    size = len(BAD_ROWS["row_too_large"])
    assert records[2]["raw"].endswith(f"...[truncated; {size} in all]")  # row_too_large keeps only a head
    assert read_manifest(out)["rejects"]["by_reason"] == {reason: 1 for reason in sorted(BAD_ROWS)}


def test_the_manifest_counts_each_inputs_pairs_by_row_form(built):
    out, _ = built
    forms = [(Path(entry["path"]).name, entry["forms"]) for entry in read_manifest(out)["inputs"]]
    assert forms == [
        ("chat.jsonl", {"explicit-chat": 10}),
        ("implicit.jsonl.zst", {"implicit-chat": 10}),
        ("text.json", {"explicit-text": 8}),
        ("multi.parquet", {"explicit-chat": 10}),
        ("bad.jsonl", {"explicit-chat": 1}),
    ]
    edited = read_manifest(out)
    edited["inputs"][2]["forms"] = {"explicit-text": 7, "implicit-text": 2}  # 9 where the input kept 8
    assert f"input {edited['inputs'][2]['path']}: its pairs by row form (forms) do not add up to its pairs" in (
        manifest_problems(edited)
    )
    del edited["inputs"][2]["forms"]  # a manifest written before forms were recorded
    assert manifest_problems(edited) == []


def test_every_documented_reason_code_is_covered(built):
    from dpo_data.audit.filter import KINDS  # the pairs dpo-data filter drops (tests/audit/test_filter.py)
    from dpo_state.schema import load_schema

    documented = set(load_schema("reject-record")["properties"]["reason"]["enum"]) - set(KINDS)
    assert documented == set(BAD_ROWS) | set(TEMPLATE_REASONS) | set(VISION_REASONS)


def test_shards_hold_pairs_in_input_order_with_sources_and_ids(built):
    out, _ = built
    m = read_manifest(out)
    tables = [open_shard(out / s["path"]) for s in m["shards"]]
    # A shard per span of 16 rows read: rows 38-56 are bad.jsonl's rejects, row 57 its good row.
    assert [t.num_rows for t in tables] == [16, 16, 6, 1]
    assert [s["path"] for s in m["shards"]] == [f"shards/shard-{span:05d}.arrow" for span in range(4)]
    rows = [r for t in tables for r in t.to_pylist()]
    assert [r["row_index"] for r in rows] == [*range(38), 38 + len(BAD_ROWS)]
    names = [
        name
        for shard, t in zip(m["shards"], tables)
        for name in (shard["sources"][i] for i in t["source_id"].to_pylist())
    ]
    assert names[:10] == ["chat"] * 10
    assert set(names[20:28]) == {"geo"}  # the row's own source wins
    assert [s["sources"] for s in m["shards"]] == [
        ["chat", "implicit"],
        ["implicit", "geo", "multi"],
        ["multi"],
        ["bad"],
    ]
    assert [t["source_id"].to_pylist()[0] for t in tables] == [0, 0, 0, 0]  # ids of the shard's own
    assert [r["row_id"] for r in rows[28:38]] == [f"p{i}" for i in range(10)]
    assert {s["name"]: s["pairs"] for s in m["sources"]} == {
        "chat": 10,
        "implicit": 10,
        "geo": 8,
        "multi": 10,
        "bad": 1,
    }
    for r in rows:
        assert r["prompt_len"] == len(r["prompt_ids"]) and r["chosen_len"] == len(r["chosen_ids"])


def test_the_manifest_records_producer_inputs_tokenizer_and_lengths(built, mixed_inputs):
    out, _ = built
    m = read_manifest(out)
    assert m["producer"]["options"]["max_length"] == 256
    assert [e["path"] for e in m["inputs"]] == list(map(str, files(mixed_inputs)))
    assert m["tokenizer"]["fingerprint"].startswith("v2:")
    assert sum(m["length_histogram"]["counts"]) == 2 * m["totals"]["pairs"]
    assert m["lengths"]["segment"]["max"] <= 256


SAMPLE_FINGERPRINT = "sha256:b442086c005ef87b990ef2ddda663c447ab7b6ca22e845849ad1fac31c3f6cfa"
"""The bundled sample's dataset fingerprint with SmolLM2's tokenizer, as every build of manifest format 3 (shards
by span of rows, source ids per shard: issue 26) makes it."""


def test_existing_inputs_still_build_the_same_dataset(sample_dataset):
    """New row shapes and options must not change a byte of what existing inputs build: their fingerprint (the
    tokenizer, sources and every shard's sha256) is pinned."""
    assert read_manifest(sample_dataset)["fingerprint"] == SAMPLE_FINGERPRINT


def test_build_is_byte_identical_across_num_proc(mixed_inputs, smollm2_dir, tmp_path, run_cli):
    outs = []
    for n in (1, 2):
        out = tmp_path / f"n{n}"
        r = build(run_cli, smollm2_dir, out, *files(mixed_inputs), extra=["--num-proc", n, "--pairs-per-shard", "16"])
        assert r.exit_code == 0, r.output
        outs.append(out)
    names = sorted(p.relative_to(outs[0]) for p in outs[0].rglob("*") if p.is_file())
    assert names == sorted(p.relative_to(outs[1]) for p in outs[1].rglob("*") if p.is_file())
    for name in names:
        assert (outs[0] / name).read_bytes() == (outs[1] / name).read_bytes(), name


def test_an_existing_out_is_refused_without_overwrite(built, mixed_inputs, smollm2_dir, run_cli):
    out, _ = built
    r = build(run_cli, smollm2_dir, out, mixed_inputs / "chat.jsonl")
    assert r.exit_code == 2 and "already exists; pass --overwrite" in r.output


def test_no_surviving_pair_fails_and_keeps_an_existing_dataset(mixed_inputs, smollm2_dir, tmp_path, run_cli):
    out = tmp_path / "ds"
    assert build(run_cli, smollm2_dir, out, mixed_inputs / "chat.jsonl").exit_code == 0
    before = (out / "manifest.json").read_bytes()
    bad = write_jsonl(tmp_path / "allbad.jsonl", [b"{", b"[]"])
    r = build(run_cli, smollm2_dir, out, bad, extra=["--overwrite"])
    assert r.exit_code == 1 and "no pair survived: all 2 rows read were rejected" in r.output
    assert (out / "manifest.json").read_bytes() == before  # the old dataset is untouched
    (incomplete,) = tmp_path.glob("ds.incomplete-*")  # this build's own staging directory, kept for its rejects
    assert (
        not (incomplete / "manifest.json").exists()
        and len((incomplete / "rejects.jsonl").read_text().splitlines()) == 2
    )


def test_too_many_rejects_fail_the_build(mixed_inputs, smollm2_dir, tmp_path, run_cli):
    r = build(
        run_cli,
        smollm2_dir,
        tmp_path / "ds",
        mixed_inputs / "bad.jsonl",
        extra=["--max-reject-fraction", "0.5", "--max-length", "256", "--max-row-bytes", "2048"],
    )
    assert r.exit_code == 1 and f"{len(BAD_ROWS)} of {len(BAD_ROWS) + 1} rows were rejected" in r.output
    assert not (tmp_path / "ds").exists()


def test_source_option_names_a_single_input(mixed_inputs, smollm2_dir, tmp_path, run_cli):
    r = build(run_cli, smollm2_dir, tmp_path / "ds", mixed_inputs / "chat.jsonl", extra=["--source", "arith"])
    assert r.exit_code == 0
    assert [s["name"] for s in read_manifest(tmp_path / "ds")["sources"]] == ["arith"]
    r = build(run_cli, smollm2_dir, tmp_path / "ds2", *files(mixed_inputs)[:2], extra=["--source", "arith"])
    assert r.exit_code == 2 and "names the source of a single input" in r.output


def test_a_corrupt_input_file_is_an_error_naming_it_without_a_traceback(mixed_inputs, smollm2_dir, tmp_path, run_cli):
    broken = tmp_path / "broken.jsonl.zst"
    broken.write_bytes((mixed_inputs / "implicit.jsonl.zst").read_bytes()[:-9])
    r = build(run_cli, smollm2_dir, tmp_path / "o", broken)  # in-process: an uncaught error would raise here
    assert r.exit_code == 2
    assert f"error: input file {broken}: truncated: the last zstd frame is incomplete" in r.stderr
    assert "Traceback" not in r.stderr and not (tmp_path / "o").exists()


def test_bad_options_are_errors_naming_the_value(mixed_inputs, smollm2_dir, tmp_path, run_cli):
    r = build(run_cli, smollm2_dir, tmp_path / "o", mixed_inputs / "chat.jsonl", extra=["--max-length", "1"])
    assert r.exit_code == 2 and "--max-length is 1; it must be at least 2" in r.output
    r = build(run_cli, tmp_path / "nowhere", tmp_path / "o", mixed_inputs / "chat.jsonl")
    assert r.exit_code == 2 and "not a directory" in r.output


@pytest.mark.parametrize("value", ["1000", str(1 << 25)])  # a bound, and the default written out
def test_max_image_pixels_on_a_text_build_is_a_usage_error(mixed_inputs, smollm2_dir, tmp_path, run_cli, value):
    """Before: accepted and ignored (a text build has no images to bound), exit 0."""
    out = tmp_path / "o"
    r = build(run_cli, smollm2_dir, out, mixed_inputs / "chat.jsonl", extra=["--max-image-pixels", value])
    assert r.exit_code == 2 and r.stdout == "" and "Traceback" not in r.stderr
    assert r.stderr == (
        f"error: --max-image-pixels {value}: it applies only to a vision build (--processor DIR), and this build is a "
        "text build (--tokenizer DIR); drop --max-image-pixels, or build data with images with --processor DIR\n"
    )
    assert not out.exists()
    assert "--processor builds only (an error with --tokenizer)" in " ".join(
        run_cli(dpo_data, "build", "--help").stdout.split()
    )


def test_the_library_refuses_max_image_pixels_without_a_processor(mixed_inputs, smollm2_dir, tmp_path):
    from dpo_data import BuildOptions
    from dpo_data import build as run_build
    from dpo_data.errors import DataError

    with pytest.raises(DataError, match="--max-image-pixels 1000: it applies only to a vision build"):
        run_build(
            [str(mixed_inputs / "chat.jsonl")], str(smollm2_dir), tmp_path / "o", BuildOptions(max_image_pixels=1000)
        )
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("row_ids", [["a", None, "é" * 3, ""] * 3, ["x", "y"], [None, None, None], []])
def test_shard_columns_built_from_buffers_write_the_bytes_pa_array_writes(row_ids):
    """Shards build their columns from buffers (`pa.array` imports pandas on first use); the IPC bytes must be
    those `pa.array` gives, nulls and multi-byte text included, so fingerprints stay pinned."""
    from dpo_data.dataset.shards import _numbers, _strings

    def ipc(array: pa.Array) -> bytes:
        sink, batch = io.BytesIO(), pa.RecordBatch.from_arrays([array], names=["c"])
        with pa.ipc.new_file(sink, batch.schema) as writer:
            writer.write_batch(batch)
        return sink.getvalue()

    assert ipc(_strings(row_ids)) == ipc(pa.array(row_ids, pa.string()))
    lengths = np.arange(3 * len(row_ids), dtype=np.int32).reshape(-1, 3)
    assert ipc(_numbers(lengths[:, 1])) == ipc(pa.array(np.ascontiguousarray(lengths[:, 1])))
    assert _strings(row_ids).to_pylist() == row_ids


def test_shard_columns_read_as_numpy_are_what_to_numpy_gives_and_nulls_are_named():
    """`as_numpy` reads columns without pyarrow's pandas bridge: the values `to_numpy` gives, for sliced,
    chunked and empty arrays of each width; a column with nulls (no built shard has one) is a DataError."""
    from dpo_data.dataset.shards import _numbers, as_numpy
    from dpo_data.errors import DataError

    for dtype in (np.int32, np.int64, np.float32):
        values = np.arange(10, dtype=dtype) * 3
        array = _numbers(values)
        for piece in (array, array.slice(3, 4), array.slice(10), pa.chunked_array([array.slice(0, 2), array.slice(7)])):
            got = as_numpy(piece)
            assert got.dtype == dtype and np.array_equal(got, piece.to_numpy()), (dtype, piece)
    listed = pa.ListArray.from_arrays(_numbers(np.array([0, 2, 5], np.int32)), _numbers(np.arange(5, dtype=np.int32)))
    assert as_numpy(listed.slice(1).offsets).tolist() == [2, 5]
    with pytest.raises(DataError, match="holds 1 nulls"):
        as_numpy(pa.array([1, None, 3], pa.int32()))
    with pytest.raises(TypeError, match="not bool"):
        as_numpy(pa.array([True]))
