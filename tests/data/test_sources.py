"""Reading input files: every format, frames, numbering, and whole-file errors that name the file."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zstandard

from dpo_data.errors import DataError, InputFileError
from dpo_data.prepare.inputs import OversizedLine, detect_format, iter_rows, open_input, source_name


def rows_of(path, max_row_bytes=1 << 20):
    return list(iter_rows(open_input(str(path)), max_row_bytes))


def test_formats_are_detected_from_suffixes():
    assert [detect_format(p) for p in ("a.jsonl", "a.JSONL.zst", "a.json", "b.parquet")] == [
        "jsonl",
        "jsonl.zst",
        "json",
        "parquet",
    ]
    assert source_name("dir/helpful.jsonl.zst") == "helpful"
    with pytest.raises(DataError, match=r"unknown file type; allowed suffixes are .*\.jsonl"):
        detect_format("rows.csv")


def test_jsonl_lines_keep_their_numbers_across_blank_lines(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"a": 1}\n\n   \n{"a": 2}\n')
    assert rows_of(path) == [(1, b'{"a": 1}'), (4, b'{"a": 2}')]


def test_a_last_line_without_newline_is_a_row_when_it_parses(tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": 2}')
    assert [n for n, _ in rows_of(path)] == [1, 2]


def test_a_cut_off_jsonl_file_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "cut.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a": 2, "b": "unfini')
    with pytest.raises(InputFileError, match=r"cut\.jsonl: truncated: line 2"):
        rows_of(path)


def test_every_zstd_frame_is_read(tmp_path):
    path = tmp_path / "multi.jsonl.zst"
    c = zstandard.ZstdCompressor()
    path.write_bytes(c.compress(b'{"a": 1}\n{"a": 2}\n') + c.compress(b'{"a": 3}\n'))
    assert [item for _, item in rows_of(path)] == [b'{"a": 1}', b'{"a": 2}', b'{"a": 3}']


def test_a_truncated_zstd_file_is_an_error_not_a_short_read(tmp_path):
    data = zstandard.ZstdCompressor().compress(b'{"a": 1}\n' * 1000)
    path = tmp_path / "cut.jsonl.zst"
    path.write_bytes(data[: len(data) - 7])
    with pytest.raises(InputFileError, match=r"cut\.jsonl\.zst: truncated: the last zstd frame is incomplete"):
        rows_of(path)


def test_a_corrupt_zstd_file_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "bad.jsonl.zst"
    path.write_bytes(b"this is not zstd at all" * 10)
    with pytest.raises(InputFileError, match=r"bad\.jsonl\.zst: read failed"):
        rows_of(path)


def test_json_arrays_number_rows_from_one(tmp_path):
    path = tmp_path / "a.json"
    path.write_bytes(b'[{"a": 1}, 7, {"a": 3}]')
    assert rows_of(path) == [(1, {"a": 1}), (2, 7), (3, {"a": 3})]


@pytest.mark.parametrize(
    "content, message", [(b'{"a": 1}', "must be an array"), (b'[{"a": 1}, {"a"', "not valid JSON")]
)
def test_a_json_file_that_is_not_an_array_is_an_error(tmp_path, content, message):
    path = tmp_path / "a.json"
    path.write_bytes(content)
    with pytest.raises(InputFileError, match=message):
        rows_of(path)


def test_parquet_rows_arrive_parsed_with_nested_messages(tmp_path):
    path = tmp_path / "a.parquet"
    msgs = [[{"role": "user", "content": "hi"}]]
    pq.write_table(pa.table({"prompt": msgs, "id": ["x"]}), path)
    assert rows_of(path) == [(1, {"prompt": [{"role": "user", "content": "hi"}], "id": "x"})]


def test_a_truncated_parquet_file_is_an_error_naming_the_file(tmp_path):
    path = tmp_path / "cut.parquet"
    pq.write_table(pa.table({"a": list(range(1000))}), path)
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(InputFileError, match=r"cut\.parquet: corrupt or unreadable parquet"):
        rows_of(path)


def test_an_oversized_line_is_skipped_whole_and_later_lines_still_read(tmp_path):
    path = tmp_path / "big.jsonl"
    path.write_bytes(b'{"a": "' + b"x" * 5000 + b'"}\n{"a": 2}\n')
    (n1, big), (n2, small) = rows_of(path, max_row_bytes=1024)
    assert (n1, n2, small) == (1, 2, b'{"a": 2}')
    assert isinstance(big, OversizedLine) and big.size == 5009 and len(big.head) == 1024


def test_a_missing_input_is_an_error_naming_it(tmp_path):
    with pytest.raises(InputFileError, match=r"nope\.jsonl: no such file"):
        open_input(str(tmp_path / "nope.jsonl"))


def test_a_parquet_map_column_is_named_as_a_map_not_as_messages(tmp_path):
    """pyarrow reads a map<string, string> as (key, value) tuples; a prompt of them is no message list."""
    from dpo_data.prepare.rows import RowReject, normalize_row

    path = tmp_path / "map.parquet"
    prompt = pa.array([[("role", "user"), ("content", "hi")]], type=pa.map_(pa.string(), pa.string()))
    pq.write_table(pa.table({"prompt": prompt, "chosen": ["a"], "rejected": ["b"]}), path)
    ((_, row),) = rows_of(path)
    with pytest.raises(RowReject) as e:
        normalize_row(row)
    assert (e.value.reason, e.value.message) == (
        "wrong_type",
        "field 'prompt' must be a string or a list of messages, got a map of str to str (a Parquet or Arrow map "
        "column)",
    )


# -- hf:// inputs: a hand-made Hugging Face cache, snapshot_download replaced (no network) ------------------------

COMMIT = "0123456789abcdef0123456789abcdef01234567"


@pytest.fixture
def hub_cache(tmp_path, monkeypatch):
    """The cache layout huggingface_hub leaves: snapshots/COMMIT/data/*.jsonl linked to ../../../blobs/HASH."""
    import huggingface_hub

    repo = tmp_path / "hub" / "datasets--o--n"
    snapshot = repo / "snapshots" / COMMIT
    (snapshot / "data").mkdir(parents=True)
    (repo / "blobs").mkdir()
    (repo / "blobs" / "abc").write_text('{"a": 1}\n')
    (snapshot / "data" / "train.jsonl").symlink_to("../../../blobs/abc")
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *a, **k: str(snapshot))
    return snapshot


def test_a_hub_file_linked_into_its_repo_blobs_is_an_input(hub_cache):
    from dpo_data.prepare.hub import hub_files

    assert hub_files("hf://datasets/o/n/data/*.jsonl") == [str(hub_cache / "data" / "train.jsonl")]


@pytest.mark.parametrize(
    "spec, says",
    [
        ("hf://datasets/o/n/../../../../outside.jsonl", "GLOB '../../../../outside.jsonl' is climbing out with .."),
        ("hf://datasets/o/n/data/../../x.jsonl", "GLOB 'data/../../x.jsonl' is climbing out with .."),
        ("hf://datasets/o/n//etc/passwd", "GLOB '/etc/passwd' is absolute"),
    ],
)
def test_a_hub_glob_that_leaves_the_repo_is_refused_by_name(hub_cache, spec, says):
    from dpo_data.prepare.hub import hub_files

    (hub_cache.parents[3] / "outside.jsonl").write_text('{"a": 1}\n')
    with pytest.raises(DataError) as e:
        hub_files(spec)
    assert str(e.value) == (
        f"input {spec}: {says}; a GLOB names files inside the dataset repo, relative to its root (e.g. "
        "data/train-*.parquet)"
    )


@pytest.mark.parametrize("target", ["outside", "other-repo-blob"])
def test_a_snapshot_file_linked_outside_its_repo_is_refused(hub_cache, target):
    """A link to a local file, or to another repo's blob, would be recorded as this repo's file at this commit."""
    from dpo_data.prepare.hub import hub_files

    leak = hub_cache.parents[3] / "secret.jsonl"
    if target == "other-repo-blob":
        leak = hub_cache.parents[2] / "datasets--x--y" / "blobs" / "def"
        leak.parent.mkdir(parents=True)
    leak.write_text('{"a": 2}\n')
    (hub_cache / "data" / "leak.jsonl").symlink_to(leak)
    with pytest.raises(DataError) as e:
        hub_files("hf://datasets/o/n/data/*.jsonl")
    assert str(e.value) == (
        f"input hf://datasets/o/n/data/*.jsonl: {hub_cache / 'data' / 'leak.jsonl'} leads to {leak}, outside the "
        f"dataset's snapshot {hub_cache} and its blob store, so it is no file of the repo at that commit. Fix: remove "
        "that link from the Hugging Face cache and download the dataset again (`hf download --repo-type dataset ...`)"
    )


def test_a_hub_input_of_another_kind_than_datasets_is_named(tmp_path):
    """Today such a path is taken for a local file: "no such file"."""
    from dpo_data.prepare.build import BuildOptions, build

    spec = "hf://models/HuggingFaceTB/SmolLM2-135M-Instruct/*.json"
    with pytest.raises(DataError) as e:
        build([spec], str(tmp_path), tmp_path / "out", BuildOptions())
    assert str(e.value) == (
        f"input {spec}: only hf://datasets/... is supported as an input, not hf://models/... (a model or space repo "
        "holds no training rows); allowed: hf://datasets/OWNER/NAME[@REVISION]/GLOB, e.g. "
        "hf://datasets/HuggingFaceH4/ultrafeedback_binarized/data/train_prefs-*.parquet"
    )
    assert not list(tmp_path.iterdir())
