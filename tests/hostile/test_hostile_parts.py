"""Hostile parts and merges: bad part numbers, edited part.json counts and spans, damaged rejects, misplaced outputs."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from dpo_cli.data import main as dpo_data
from dpo_data.dataset.manifest import dataset_fingerprint
from dpo_data.dataset.verify import verify_dataset
from dpo_data.errors import DataError
from dpo_data.prepare.merge import merge
from dpo_data.prepare.parts import MAX_PARTS, resolve_part
from dpo_state.digest import file_digest
from dpo_train.config.loading import load_config
from dpo_train.errors import ConfigError
from dpo_train.run.directory import check_output_dir
from tests.conftest import chat, write_jsonl
from tests.data.test_build_parts import _copies, _edit_part, _parts
from tests.harness import tiny_config


@pytest.fixture(scope="module")
def hostile_inputs(tmp_path_factory) -> list[str]:
    """32 rows in 4 spans of 8: part 0 of 2 builds spans 0 and 2, part 1 spans 1 and 3. Each part has two reject
    reasons, rows of sources chat, geo and long, and long prompts that --max-length 256 truncates."""
    d = tmp_path_factory.mktemp("hostile-parts")
    rows = [
        {**chat(f"Add {i} and 2?", f"{i + 2}.", f"{i + 3}."), "source": "geo" if i % 4 == 1 else "chat"}
        for i in range(20)
    ]
    rows[3] = {"prompt": "Q", "chosen": " same", "rejected": " same"}  # identical_completions (span 0)
    rows[11] = {"prompt": "Q"}  # missing_field (span 1)
    long = [chat("word " * (300 if i % 2 == 0 else 5) + f"{i}?", f"Yes {i}.", f"No {i}.") for i in range(12)]
    long[5] = {"prompt": "Q", "chosen": " same", "rejected": " same"}  # span 3
    return [str(write_jsonl(d / "chat.jsonl", rows)), str(write_jsonl(d / "long.jsonl", long))]


@pytest.fixture(scope="module")
def two_parts(hostile_inputs, smollm2_dir, tmp_path_factory) -> list[Path]:
    parts = _parts(hostile_inputs, smollm2_dir, tmp_path_factory.mktemp("two"), 2, overlength="truncate-prompt")
    counts = [json.loads((p / "part.json").read_text())["counts"] for p in parts]
    assert [c["truncated_prompts"] for c in counts] == [2, 4], counts
    assert counts[1]["by_reason"] == {"identical_completions": 1, "missing_field": 1}, counts
    return parts


@pytest.fixture(scope="module")
def merged(two_parts, tmp_path_factory) -> Path:
    """The two parts merged: every new check passes on an honest build."""
    out = tmp_path_factory.mktemp("merged") / "ds"
    assert merge(two_parts, out).manifest is not None
    assert verify_dataset(out, strict=True) == []
    return out


def _one_line_error(result, pattern: str) -> None:
    """The CLI refused with exit 2 and one line naming it (after any progress lines), no traceback."""
    lines = result.stderr.splitlines()
    assert result.exit_code == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert [line for line in lines if line.startswith("error")] == lines[-1:], result.stderr[-2000:]
    assert re.search(pattern, lines[-1]), lines[-1]


# -- the part number ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "given, message",
    [
        ("²/3", r"--part is '²/3'; allowed: K/N with integers 0 <= K < N <= 100000 in ASCII digits"),
        ("1/²", r"--part is '1/²'; allowed"),
        ("0/18446744073709551616", r"--part is '0/18446744073709551616'; allowed: .* N <= 100000"),
        ("0/1000000000000", r"--part is '0/1000000000000'; allowed"),
        ("0/100001", r"--part gives part 0/100001; N is at most 100000 \(a part per task of a job array\)"),
        pytest.param("7/" + "9" * 5000, r"--part is '7/9999.*\.\.\. \(5002 characters\); allowed", id="5000-digits"),
    ],
)
def test_a_bad_part_number_is_one_line_before_any_input_is_read(given, message, tmp_path, run_cli, smollm2_dir):
    """Before: ValueError tracebacks ('²'.isdigit() but int('²') fails), a TypeError after reading every input, and
    N = 10**12 built a part whose merge named every missing part. The input here does not exist: the part is
    refused first."""
    out = tmp_path / "p"
    r = run_cli(dpo_data, "build", tmp_path / "absent.jsonl", "--tokenizer", smollm2_dir, "--out", out, "--part", given)
    _one_line_error(r, message)
    assert not out.exists()


def test_a_slurm_task_id_in_other_digits_is_one_line(tmp_path, run_cli, smollm2_dir, monkeypatch):
    for key, value in dict(ID="²", MIN="0", MAX="2", COUNT="3").items():
        monkeypatch.setenv(f"SLURM_ARRAY_TASK_{key}", value)
    r = run_cli(dpo_data, "build", tmp_path / "absent.jsonl", "--tokenizer", smollm2_dir, "--out", tmp_path / "p")
    _one_line_error(r, r"SLURM_ARRAY_TASK_ID is '²' in a Slurm job array task, not a number in ASCII digits")
    monkeypatch.setenv("SLURM_ARRAY_TASK_COUNT", "1" * 30)
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "1")
    with pytest.raises(DataError, match=r"SLURM_ARRAY_TASK_COUNT is '1{30}' in a Slurm job array task"):
        resolve_part(None)


def test_the_part_schema_bounds_n_as_the_cli_does(two_parts, tmp_path):
    """Before: a part.json of part 0/10**6 merged into a message naming 999,999 missing parts, one by one."""
    parts = _copies(two_parts, tmp_path)
    _edit_part(parts[0], lambda doc: (doc["part"].update(count=10**6), doc["plan"].update(parts=10**6)))
    with pytest.raises(DataError, match=r"does not match schemas/dataset-part.schema.json:\n  - .*greater than"):
        merge(parts[:1], tmp_path / "ds")
    schema = json.loads((Path(__file__).parents[2] / "schemas" / "dataset-part.schema.json").read_text())
    assert schema["$defs"]["parts"]["maximum"] == MAX_PARTS


def test_missing_parts_are_named_as_runs(two_parts, tmp_path):
    parts = _copies(two_parts, tmp_path)
    for part, k in zip(parts, (0, 8)):
        _edit_part(part, lambda doc, k=k: (doc["part"].update(index=k, count=16), doc["plan"].update(parts=16)))
    with pytest.raises(DataError, match=r"parts 1/16 to 7/16, 9/16 to 15/16 of 16 are missing \(given: 2\)"):
        merge(parts, tmp_path / "ds")


# -- part.json against its shards and rejects -----------------------------------------------------------------


def _move(counts: dict, a: str, b: str) -> None:
    """One count from key `a` to key `b`: the totals still add up (a count of 0 is left out, as a build does)."""
    counts[a] -= 1
    counts[b] = counts.get(b, 0) + 1
    if not counts[a]:
        del counts[a]


EDITS = {
    "counts.sources": (
        lambda d: _move(d["counts"]["sources"], "long", "chat"),
        r"is \{'chat': 6, 'geo': 2, 'long': 6\}, its shards and rejects give \{'chat': 5, 'geo': 2, 'long': 7\}",
    ),
    "counts.max_token_id": (lambda d: d["counts"].update(max_token_id=d["counts"]["max_token_id"] + 1), r"is \d+, its"),
    "counts.by_reason": (
        lambda d: _move(d["counts"]["by_reason"], "missing_field", "identical_completions"),
        r"is \{'identical_completions': 2\}, its shards and rejects give \{'identical_completions': 1, 'missing_",
    ),
    "counts.source_rejects": (
        lambda d: _move(d["counts"]["source_rejects"], "chat", "long"),
        r"is \{'long': 2\}, its shards and rejects give \{'chat': 1, 'long': 1\}",
    ),
    "inputs[0].rows_read": (  # a row moved to the other input: the part's rows still add up
        lambda d: [entry.update(rows_read=entry["rows_read"] + step) for entry, step in zip(d["inputs"], (-1, 1))],
        r"is 7, its shards and rejects give 8 \(and 2 more\)",  # inputs[1].rows_read, inputs[0].columns
    ),
    "inputs[0].forms (pairs by row form, added up)": (
        lambda d: d["inputs"][0]["forms"].update({"implicit-text": 1}),
        r"is (\d+), its shards and rejects give (?!\1)\d+",
    ),
    "counts.truncated_prompts": (
        lambda d: d["counts"].update(truncated_prompts=d["counts"]["truncated_prompts"] + 1),
        r"is 5; allowed: at most 4, the pairs whose prompt \+ longest completion is exactly --max-length 256",
    ),
    "counts.truncated_prompt_tokens": (
        lambda d: d["counts"].update(truncated_prompt_tokens=2),
        r"is 2 for 4 truncated prompts; each truncated prompt loses at least one token",
    ),
}


@pytest.mark.parametrize("field", EDITS)
def test_an_edited_count_is_refused_naming_the_part_the_field_and_both_values(field, two_parts, tmp_path):
    """Before: each merged into a silently wrong manifest (truncated_prompts passed verify too)."""
    edit, values = EDITS[field]
    parts = _copies(two_parts, tmp_path)
    _edit_part(parts[1], edit)
    message = rf"part 1/2 \({parts[1]}\): its part.json says {re.escape(field)} {values}"
    with pytest.raises(DataError, match=message + r".*; the file was edited or damaged: rebuild that part"):
        merge(parts, tmp_path / "ds")
    assert not (tmp_path / "ds").exists() and not list(tmp_path.glob("ds.incomplete-*"))


def _swap_shards(doc: dict, keys: tuple[str, ...]) -> None:
    first, second = doc["shards"][:2]
    for key in keys:
        first[key], second[key] = second[key], first[key]


@pytest.mark.parametrize(
    "swapped, message",
    [
        (("span",), r"its part.json lists span 2 as shards/shard-00000.arrow, not shards/shard-00002.arrow"),
        (("span", "path", "rows", "bytes", "sha256", "sources"), r"its part.json lists span 0 after span 2; a part's"),
        (("rows", "bytes", "sha256", "sources"), r"shard-00000.arrow: row_index is not increasing within span 0, rows"),
    ],
    ids=["spans", "records", "files"],
)
def test_swapped_spans_are_refused_by_the_merge(swapped, message, two_parts, tmp_path):
    """Part 0's spans 0 and 2 swapped in its part.json (and, for "files", the shard files swapped with their records).
    Before: "spans" merged with those pairs in the other order, "records" was put back in order silently."""
    parts = _copies(two_parts, tmp_path)
    if swapped[0] == "rows":
        a, b = (parts[0] / "shards" / f"shard-0000{k}.arrow" for k in (0, 2))
        a.rename(tmp_path / "moved")
        b.rename(a)
        (tmp_path / "moved").rename(b)
    _edit_part(parts[0], lambda doc: _swap_shards(doc, swapped))
    with pytest.raises(DataError, match=message):
        merge(parts, tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


def _rewrite_rejects(part: Path, change) -> None:
    """Change part's rejects.jsonl lines, and record its new bytes and sha256 in part.json, as an editor would."""
    path = part / "rejects.jsonl"
    path.write_bytes(b"".join(change(path.read_bytes().splitlines(keepends=True))))
    _edit_part(part, lambda doc: doc["rejects"].update(bytes=path.stat().st_size, sha256=file_digest(path)))


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda lines: [lines[0], b"{not json\n"], r"line 2: not a JSON line"),
        (lambda lines: [lines[0], b"[1, 2]\n"], r"line 2: a JSON list, not a reject record"),
        (lambda lines: [lines[0].replace(b"chat.jsonl", b"other.jsonl"), lines[1]], r"line 1: file '.*other.jsonl' is"),
        (lambda lines: list(reversed(lines)), r"line 2: not in input order \(after row 6 of input 1\)"),
    ],
)
def test_a_damaged_rejects_file_recorded_in_part_json_is_named_by_line(change, message, two_parts, tmp_path, run_cli):
    """Before: an orjson.JSONDecodeError or KeyError traceback."""
    parts = _copies(two_parts, tmp_path)
    _rewrite_rejects(parts[1], change)
    r = run_cli(dpo_data, "merge", *parts, "--out", tmp_path / "ds")
    _one_line_error(r, rf"part 1/2: {re.escape(str(parts[1]))}/rejects.jsonl {message}.*rebuild that part")
    assert not (tmp_path / "ds").exists() and not list(tmp_path.glob("ds.incomplete-*"))


# -- verify, on the merged dataset ----------------------------------------------------------------------------


def _edit_manifest(dataset: Path, edit) -> None:
    """Edit a manifest and keep it self-consistent (offsets, fingerprint), as a careful editor would."""
    path = dataset / "manifest.json"
    m = json.loads(path.read_text())
    edit(m)
    offset = 0
    for shard in m["shards"]:
        shard["first_pair_index"], offset = offset, offset + shard["rows"]
    m["fingerprint"] = dataset_fingerprint(m["tokenizer"]["fingerprint"], m["sources"], m["shards"])
    path.write_text(json.dumps(m))


@pytest.mark.parametrize(
    "edit, failure",
    [
        (
            lambda m: m["shards"].insert(0, m["shards"].pop(1)),
            "shards/shard-00000.arrow: listed after span 1; the manifest lists shards in ascending span order",
        ),
        (
            lambda m: m["totals"].update(truncated_prompts=m["totals"]["truncated_prompts"] + 1),
            "totals.truncated_prompts is 7; allowed: at most 6, the pairs whose prompt + longest completion is "
            "exactly --max-length 256",
        ),
        (
            lambda m: _move(m["rejects"]["by_reason"], "missing_field", "identical_completions"),
            "rejects.by_reason: manifest says {'identical_completions': 3}, rejects.jsonl holds "
            "{'identical_completions': 2, 'missing_field': 1}",
        ),
    ],
    ids=["span-order", "truncated_prompts", "by_reason"],
)
def test_verify_names_a_span_order_or_a_count_the_shards_and_rejects_contradict(edit, failure, merged, tmp_path):
    """Before: each passed verify (a swapped pair of shards reorders the pairs against the single build)."""
    import shutil

    dataset = Path(shutil.copytree(merged, tmp_path / "ds"))
    _edit_manifest(dataset, edit)
    assert [f for f in verify_dataset(dataset) if f.startswith(failure)], verify_dataset(dataset)


# -- where a merge or a run may write -------------------------------------------------------------------------


def test_a_merge_into_a_part_directory_is_refused(two_parts, tmp_path):
    """Before: it merged into parts/part-0/ds, which deleting the parts (as the docs suggest) then deleted."""
    parts = _copies(two_parts, tmp_path)
    with pytest.raises(DataError, match=rf"--out {parts[0]}/ds lies inside the part directory {parts[0]}; deleting"):
        merge(parts, parts[0] / "ds")
    assert not (parts[0] / "ds").exists() and not (parts[0] / "ds.lock").exists()


@pytest.mark.parametrize(
    "where, message",
    [
        ("part", r"is or lies inside the dataset part at .*part-0 \(it holds part.json and shards/\)"),
        ("part/run", r"is or lies inside the dataset part at .*part-0 "),
        ("runs/x.incomplete-0123456789ab", r"named as a dpo-data build's staging directory"),
        ("ds.incomplete-000000000000/run", r"is or lies inside .*ds.incomplete-000000000000, named as a dpo-data"),
    ],
)
def test_a_run_directory_in_a_part_or_a_staging_directory_is_refused(where, message, two_parts, merged, tmp_path):
    """Before: a run went into a part (deleted after the merge) or a staging directory (deleted by the next build)."""
    output_dir = str(two_parts[0]) + where.removeprefix("part") if where.startswith("part") else tmp_path / where
    config = load_config(tiny_config(merged, Path("tokenizer"), output_dir))
    with pytest.raises(ConfigError, match=message):
        check_output_dir(config)
