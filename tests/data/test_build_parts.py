"""`dpo-data build --part K/N` + `dpo-data merge`: parts joined into the single build's dataset, bit for bit."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dpo_cli.data import main as dpo_data
from dpo_data.dataset.manifest import read_manifest
from dpo_data.dataset.store import PairStore
from dpo_data.dataset.verify import verify_dataset
from dpo_data.errors import DataError
from dpo_data.prepare.build import BuildOptions, build
from dpo_data.prepare.merge import merge
from dpo_data.prepare.parts import Part, resolve_part
from dpo_state.digest import DIGEST_PREFIX, sha256_json
from tests.conftest import chat, write_jsonl

SPAN = 8  # --pairs-per-shard: rows per span, so these inputs make 11 spans


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> list[str]:
    """Files of very unequal size (50, 7 and 26 rows), rejects among them, rows naming their own source."""
    d = tmp_path_factory.mktemp("parts-inputs")
    big = [chat(f"What is {i} times 3?", f"{3 * i}.", f"{3 * i + 1}.") for i in range(50)]
    for i in (4, 17, 18, 30):
        big[i] = {"prompt": "Q", "chosen": " same", "rejected": " same"}  # identical_completions
    small = [{**chat(f"Capital {i}?", f"City {i}.", f"Town {i}."), "source": "geo"} for i in range(7)]
    mixed = [chat(f"Say {i}.", f"{i}", f"not {i}") if i % 5 else {"prompt": "Q"} for i in range(26)]
    return [
        str(write_jsonl(d / name, rows))
        for name, rows in (("big.jsonl", big), ("geo.jsonl", small), ("mix.jsonl", mixed))
    ]


def _options(**extra) -> BuildOptions:
    return BuildOptions(max_length=256, pairs_per_shard=SPAN, **extra)


@pytest.fixture(scope="module")
def single(inputs, smollm2_dir, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single") / "ds"
    assert build(inputs, str(smollm2_dir), out, _options()).manifest is not None
    return out


def _parts(inputs, tokenizer, root: Path, n: int, **extra) -> list[Path]:
    dirs = []
    for k in range(n):
        out = root / f"part-{k}"
        result = build(inputs, str(tokenizer), out, _options(part=Part(k, n), **extra))
        assert result.part is not None and result.error is None
        dirs.append(out)
    return dirs


@pytest.fixture(scope="module")
def three_parts(inputs, smollm2_dir, tmp_path_factory) -> list[Path]:
    return _parts(inputs, smollm2_dir, tmp_path_factory.mktemp("three"), 3)


def _same_dataset(merged: Path, single: Path) -> None:
    """The merged dataset is the single build's: its manifest whole, every pair's ids and source, its rejects."""
    assert read_manifest(merged) == read_manifest(single)
    a, b = PairStore([merged]), PairStore([single])
    assert a.num_pairs == b.num_pairs and a.sources == b.sources
    for i in range(a.num_pairs):
        x, y = a.pair(i), b.pair(i)
        assert x.source_id == y.source_id, i
        for part in ("prompt", "chosen", "rejected"):
            assert np.array_equal(getattr(x, part), getattr(y, part)), (i, part)
    assert (merged / "rejects.jsonl").read_bytes() == (single / "rejects.jsonl").read_bytes()
    assert verify_dataset(merged, strict=True) == []


@pytest.mark.parametrize("n", [1, 2, 3])
def test_parts_merged_are_the_single_build(n, inputs, single, three_parts, smollm2_dir, tmp_path):
    parts = three_parts if n == 3 else _parts(inputs, smollm2_dir, tmp_path, n)
    merged = tmp_path / "merged"
    result = merge(list(reversed(parts)), merged)  # any order: the part index in part.json decides
    assert result.error is None
    _same_dataset(merged, single)
    m = read_manifest(single)
    assert len(m["shards"]) == 11 and m["totals"]["rejected"] == 10
    assert [s["name"] for s in m["sources"]] == ["big", "geo", "mix"]
    for shard in m["shards"]:  # linked, not copied: the merged shard is the part's file
        span = int(shard["path"][-11:-6])
        assert os.path.samefile(merged / shard["path"], parts[span % n] / shard["path"])


def test_a_part_builds_every_nth_span_of_the_global_row_order(three_parts):
    """Spans count rows across files, so part k holds spans k, k+3, ... whichever file their rows are in."""
    for k, part in enumerate(three_parts):
        doc = json.loads((part / "part.json").read_text())
        assert [s["span"] for s in doc["shards"]] == list(range(k, 11, 3))
        assert doc["rows_total"] == 83 and sum(e["rows_read"] for e in doc["inputs"]) == len(range(k, 11, 3)) * SPAN - (
            5 if k == 1 else 0  # span 10 (part 1) holds the last 3 rows only
        )
        assert not (part / "manifest.json").exists()  # a part is not a dataset


def test_a_part_is_not_a_dataset_until_merged(three_parts, run_cli):
    with pytest.raises(DataError, match=r"a part of a dpo-data build --part K/N, not a dataset; join all its parts"):
        PairStore([three_parts[0]])
    r = run_cli(dpo_data, "inspect", three_parts[0])
    assert r.exit_code == 2 and "with dpo-data merge PART_DIR... --out DIR, and use DIR" in r.output


def test_the_cli_builds_parts_and_merges_them(inputs, single, smollm2_dir, tmp_path, run_cli):
    common = ["--tokenizer", smollm2_dir, "--max-length", "256", "--pairs-per-shard", SPAN]
    for k in range(2):
        r = run_cli(dpo_data, "build", *inputs, *common, "--out", tmp_path / f"p{k}", "--part", f"{k}/2")
        assert r.exit_code == 0, r.output
        assert f"part {k}/2 at {tmp_path / f'p{k}'} written" in r.output
    r = run_cli(dpo_data, "merge", tmp_path / "p0", tmp_path / "p1", "--out", tmp_path / "ds")
    assert r.exit_code == 0, r.output
    assert f"fingerprint {read_manifest(single)['fingerprint']}" in r.output
    _same_dataset(tmp_path / "ds", single)


def test_a_finished_part_is_skipped_on_relaunch(inputs, smollm2_dir, tmp_path, run_cli):
    args = [*inputs, "--tokenizer", smollm2_dir, "--max-length", "256", "--pairs-per-shard", SPAN]
    out = tmp_path / "p1"
    assert run_cli(dpo_data, "build", *args, "--out", out, "--part", "1/2").exit_code == 0
    before = {p: p.stat().st_ino for p in out.rglob("*")}
    again = run_cli(dpo_data, "build", *args, "--out", out, "--part", "1/2")
    assert again.exit_code == 0 and "was already built with this plan; nothing to do" in again.output
    assert {p: p.stat().st_ino for p in out.rglob("*")} == before  # not a file touched


def test_a_stale_or_foreign_part_is_refused_by_name(inputs, smollm2_dir, tmp_path, run_cli):
    args = [*inputs, "--tokenizer", smollm2_dir, "--pairs-per-shard", SPAN]
    out = tmp_path / "p"
    assert run_cli(dpo_data, "build", *args, "--out", out, "--part", "0/2").exit_code == 0
    other = run_cli(dpo_data, "build", *args, "--out", out, "--part", "1/2")
    assert other.exit_code == 2 and f"--out {out} holds part 0/2 of this build, not part 1/2" in other.output
    stale = run_cli(dpo_data, "build", *args, "--max-length", "128", "--out", out, "--part", "0/2")
    assert stale.exit_code == 2 and "part 0/2 of another build (it differs in: options.max_length)" in stale.output
    assert "pass --overwrite to build part 0/2 there" in stale.output
    three = run_cli(dpo_data, "build", *args, "--out", out, "--part", "0/3")
    assert three.exit_code == 2 and "differs in: number of parts" in three.output
    rebuilt = run_cli(dpo_data, "build", *args, "--max-length", "128", "--out", out, "--part", "0/2", "--overwrite")
    assert rebuilt.exit_code == 0, rebuilt.output
    assert json.loads((out / "part.json").read_text())["plan"]["options"]["max_length"] == 128


def test_a_killed_part_is_rebuilt_alone_and_the_merge_is_still_the_single_build(
    inputs, single, three_parts, smollm2_dir, tmp_path, run_cli
):
    """Part 1 of 3 SIGKILLed just before its commit leaves no part: the merge names it missing; re-running that
    part alone (the same command line, in this process: the kill is what needs a process of its own) completes
    the build."""
    parts = [tmp_path / f"part-{k}" for k in range(3)]
    for k in (0, 2):
        os.symlink(three_parts[k], parts[k])
    args = ["build", *inputs, "--tokenizer", str(smollm2_dir)]
    args += ["--max-length", "256", "--pairs-per-shard", str(SPAN), "--out", str(parts[1]), "--part", "1/3"]
    command = [sys.executable, "-m", "dpo_cli.data", *args]
    killed = subprocess.run(command, env={**os.environ, "DPO_DATA_KILL": "before-swap"}, capture_output=True)
    assert killed.returncode == -9 and not parts[1].exists()
    with pytest.raises(DataError, match=rf"{parts[1]}: not a finished part \(no part.json"):
        merge(parts, tmp_path / "ds")
    assert not (tmp_path / "ds").exists()
    rebuilt = run_cli(dpo_data, *args)
    assert rebuilt.exit_code == 0, rebuilt.output
    merge(parts, tmp_path / "ds")
    _same_dataset(tmp_path / "ds", single)


def _edit_part(part: Path, edit) -> None:
    doc = json.loads((part / "part.json").read_text())
    edit(doc)
    doc["plan_sha256"] = DIGEST_PREFIX + sha256_json(doc["plan"])
    (part / "part.json").write_text(json.dumps(doc))


def _copies(parts: list[Path], root: Path) -> list[Path]:
    import shutil

    return [Path(shutil.copytree(p, root / p.name)) for p in parts]


def test_missing_duplicate_unfinished_and_mismatched_parts_are_named(
    inputs, three_parts, single, smollm2_dir, tmp_path
):
    out = tmp_path / "ds"
    p0, p1, p2 = three_parts
    cases = [
        ([p0, p2], r"parts 1/3 of 3 are missing \(given: 2\)"),
        ([p0, p1, p1, p2], rf"part 1/3 is given twice: {p1} and {p1}"),
        ([p0, p1, single], rf"{single}: a dataset, not a part \(no part.json"),
    ]
    two = _parts(inputs, smollm2_dir, tmp_path / "two", 2)
    cases.append(([p0, two[1], p2], r"is part of another build than part .* \(they differ in: number of parts\)"))
    shorter = _parts(inputs, smollm2_dir, tmp_path / "short", 3, max_row_bytes=4096)
    cases.append(([p0, shorter[1], p2], r"\(they differ in: options.max_row_bytes\)"))
    for given, message in cases:
        with pytest.raises(DataError, match=message):
            merge(given, out)
    assert not out.exists()


def test_a_part_from_other_code_or_edited_is_refused(three_parts, tmp_path):
    parts = _copies(three_parts, tmp_path)
    for part in parts:
        _edit_part(part, lambda doc: doc["plan"]["producer"].update(version="0.0.9"))
    with pytest.raises(DataError, match=r"the parts were built by dpo-toolkit 0.0.9, this is 0.1.0"):
        merge(parts, tmp_path / "ds")
    edited = _copies(three_parts, tmp_path / "edited")
    doc = json.loads((edited[2] / "part.json").read_text())
    doc["plan"]["options"]["max_length"] = 512  # without its plan_sha256
    (edited[2] / "part.json").write_text(json.dumps(doc))
    with pytest.raises(DataError, match=r"plan_sha256 does not match its plan; the file was edited or damaged"):
        merge(edited, tmp_path / "ds")
    for name, edit, message in [
        ("rows", lambda doc: doc["shards"][0].update(rows=99), r"holds 8 pairs, its part.json says 99; the part.json"),
        ("span", lambda doc: doc["shards"][0].update(span=0), r"lists span 0, which is not part 1/3's; the file"),
    ]:
        copies = _copies(three_parts, tmp_path / name)
        _edit_part(copies[1], edit)
        with pytest.raises(DataError, match=message):
            merge(copies, tmp_path / "ds")
    assert not (tmp_path / "ds").exists()


def test_a_damaged_part_shard_is_named_and_nothing_is_committed(three_parts, tmp_path):
    parts = _copies(three_parts, tmp_path)
    shard = sorted((parts[1] / "shards").iterdir())[0]
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(DataError, match=rf"{parts[1]}/shards/{shard.name}: sha256 differs from its part.json"):
        merge(parts, tmp_path / "ds")
    assert not (tmp_path / "ds").exists() and not list(tmp_path.glob("ds.incomplete-*"))


def test_count_refusals_wait_for_the_merge_and_commit_nothing(inputs, smollm2_dir, tmp_path, run_cli):
    """10 of 83 rows are rejected: over --max-reject-fraction 0.05 for the whole build, whatever each part holds."""
    parts = _parts(inputs, smollm2_dir, tmp_path, 2, max_reject_fraction=0.05)
    r = run_cli(dpo_data, "merge", *parts, "--out", tmp_path / "ds")
    assert r.exit_code == 1 and "10 of 83 rows were rejected (12.0%), over --max-reject-fraction 0.05" in r.output
    assert not (tmp_path / "ds").exists()


def test_the_merge_refuses_an_existing_out_and_replaces_it_with_overwrite(three_parts, single, tmp_path, run_cli):
    out = tmp_path / "ds"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    r = run_cli(dpo_data, "merge", *three_parts, "--out", out)
    assert r.exit_code == 2 and "already exists; pass --overwrite" in r.output
    r = run_cli(dpo_data, "merge", *three_parts, "--out", out, "--overwrite")
    assert r.exit_code == 2 and "is not a dataset" in r.output and (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    out.rmdir()
    assert run_cli(dpo_data, "merge", *three_parts, "--out", out).exit_code == 0
    assert run_cli(dpo_data, "merge", *three_parts, "--out", out, "--overwrite").exit_code == 0
    _same_dataset(out, single)


def test_one_merge_or_build_at_a_time_per_out(three_parts, tmp_path):
    from dpo_data.prepare.output import OutputLock

    out = tmp_path / "ds"
    with OutputLock(out):  # as a build or another merge of `out` holds it
        with pytest.raises(DataError, match=rf"--out {out} is being built by another process \(pid {os.getpid()}"):
            merge(three_parts, out)
    assert not out.exists()


def test_the_merge_links_only_within_one_filesystem(three_parts, tmp_path):
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second filesystem here")
    out = Path(shm / f"dpo-merge-{os.getpid()}") / "ds"
    with pytest.raises(DataError, match=r"never copies them: put --out on the filesystem of the parts \(they are on"):
        merge(three_parts, out)
    assert not out.exists()


@pytest.mark.parametrize(
    "given, env, expected",
    [
        ("2/4", {"SLURM_ARRAY_TASK_ID": "7"}, (2, 4)),  # --part wins
        (None, {}, None),
        (None, {f"SLURM_ARRAY_TASK_{k}": v for k, v in dict(ID="5", MIN="4", MAX="7", COUNT="4").items()}, (1, 4)),
        ("none", {f"SLURM_ARRAY_TASK_{k}": v for k, v in dict(ID="5", MIN="4", MAX="7", COUNT="4").items()}, None),
    ],
)
def test_the_part_comes_from_the_flag_or_the_slurm_array(given, env, expected):
    part = resolve_part(given, env)
    assert (part and (part.index, part.count)) == expected


@pytest.mark.parametrize(
    "given, env, message",
    [
        ("3/3", {}, r"--part gives part 3/3; a part is K/N with N >= 1 and K in 0..N-1"),
        ("three", {}, r"--part is 'three'; allowed: K/N with integers 0 <= K < N"),
        (None, {"SLURM_ARRAY_TASK_ID": "3"}, r"SLURM_ARRAY_TASK_COUNT is '' in a Slurm job array task"),
        (
            None,
            {f"SLURM_ARRAY_TASK_{k}": v for k, v in dict(ID="4", MIN="0", MAX="14", COUNT="8").items()},
            r"runs 8 tasks with ids 0..14, not consecutive; give each task its part with --part K/N",
        ),
    ],
)
def test_a_bad_part_is_a_named_error(given, env, message):
    with pytest.raises(DataError, match=message):
        resolve_part(given, env)


def test_the_cli_reads_the_part_from_a_slurm_array_task(inputs, smollm2_dir, tmp_path, run_cli, monkeypatch):
    for key, value in dict(ID="11", MIN="10", MAX="12", COUNT="3").items():
        monkeypatch.setenv(f"SLURM_ARRAY_TASK_{key}", value)
    out = tmp_path / "p"
    r = run_cli(dpo_data, "build", *inputs, "--tokenizer", smollm2_dir, "--pairs-per-shard", SPAN, "--out", out)
    assert r.exit_code == 0, r.output
    assert "part 1/3 (SLURM_ARRAY_TASK_ID=11 of 10..12)" in r.output
    assert json.loads((out / "part.json").read_text())["part"] == {"index": 1, "count": 3}


FAKE_SBATCH = """#!{python}
'''sbatch for the test: runs an array's tasks one after the other with Slurm's array variables, then a --wrap
job, as Slurm would once its dependency is met; prints a job id (--parsable).'''
import os, subprocess, sys
args, options = sys.argv[1:], {{}}
while args and args[0].startswith("--"):
    key, _, value = args.pop(0)[2:].partition("=")
    options[key] = args.pop(0) if key == "wrap" else value
log = open(os.environ["FAKE_SBATCH_LOG"], "a")
log.write(repr(sorted(options)) + "\\n")
if "wrap" in options:
    sys.exit(subprocess.run(["bash", "-c", options["wrap"]]).returncode)
first, last = map(int, options["array"].split("-"))
for task in range(first, last + 1):
    env = dict(os.environ, SLURM_ARRAY_TASK_ID=str(task), SLURM_ARRAY_TASK_MIN=str(first),
               SLURM_ARRAY_TASK_MAX=str(last), SLURM_ARRAY_TASK_COUNT=str(last - first + 1), SLURM_CPUS_PER_TASK="1")
    done = subprocess.run(["bash", *args], env=env, capture_output=True, text=True)
    log.write(done.stdout + done.stderr)
    if done.returncode:
        sys.exit(done.returncode)
print("4242")
"""


def test_the_slurm_array_example_builds_parts_and_merges_them(inputs, single, smollm2_dir, tmp_path):
    """examples/slurm/build_array.sbatch, submitted as on a login node, under an sbatch that runs the array's tasks
    here (there is no Slurm on these machines): the merged dataset is the single build's, and submitting again
    skips every finished part. An array of 2 tasks: each task and the merge is a process of its own (imports and
    a tokenizer load each), and 2 tasks already make parts, a merge of several and a finished part to skip."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "sbatch").write_text(FAKE_SBATCH.format(python=sys.executable))
    (bin_dir / "sbatch").chmod(0o755)
    log = tmp_path / "sbatch.log"
    env = {**os.environ, "PATH": f"{bin_dir}:{Path(sys.executable).parent}:{os.environ['PATH']}"}
    env["FAKE_SBATCH_LOG"] = str(log)
    script = Path(__file__).resolve().parents[2] / "examples" / "slurm" / "build_array.sbatch"
    out = tmp_path / "data" / "train"
    command = ["bash", str(script), "2", str(out), str(smollm2_dir), *inputs, "--max-length", "256"]
    command += ["--pairs-per-shard", str(SPAN)]
    submitted = subprocess.run(command, env=env, capture_output=True, text=True)
    assert submitted.returncode == 0, submitted.stderr + log.read_text()
    text = log.read_text()
    assert "['array', 'parsable']" in text and "['dependency', 'job-name', 'parsable', 'wrap']" in text
    assert [f"part {k}/2 (SLURM_ARRAY_TASK_ID={k} of 0..1)" in text for k in range(2)] == [True] * 2
    _same_dataset(out, single)
    import shutil

    shutil.rmtree(out)  # as if task 1 had failed: no part 1, so no merge either
    shutil.rmtree(f"{out}.parts/part-1")
    log.write_text("")
    again = subprocess.run(command, env=env, capture_output=True, text=True)
    assert again.returncode == 0, again.stderr + log.read_text()
    text = log.read_text()
    assert text.count("was already built with this plan; nothing to do") == 1  # part 0; part 1 rebuilt
    assert "part 1/2 (SLURM_ARRAY_TASK_ID=1 of 0..1)" in text
    _same_dataset(out, single)


def test_a_part_skips_converting_others_arrow_batches_and_still_builds_the_single_builds_pairs(
    smollm2_dir, tmp_path, monkeypatch
):
    """Parquet batches of 4 rows over spans of 8, one jsonl row before them (so a batch may end with a single
    row of the next span): a part turns only batches touching its spans into rows, and 3 parts still merge into
    the single build."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dpo_data.prepare import inputs as inputs_module
    from dpo_data.prepare.inputs import iter_rows, open_input

    monkeypatch.setattr(inputs_module, "ARROW_BATCH_ROWS", 4)
    lead = str(write_jsonl(tmp_path / "lead.jsonl", [chat("Lead?", "Yes.", "No.")]))
    rows = [chat(f"Row {i}?", f"Yes {i}.", f"No {i}.") for i in range(37)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "rows.parquet")
    given = [lead, str(tmp_path / "rows.parquet")]
    seen = [item for _, item in iter_rows(open_input(given[1]), 1 << 20, skip=lambda first, count: first > 4)]
    assert seen[:4] == rows[:4] and seen[4:] == [None] * 33  # batches after the first are never converted
    single = tmp_path / "single"
    assert build(given, str(smollm2_dir), single, _options()).manifest is not None
    merge(_parts(given, smollm2_dir, tmp_path / "parts", 3), tmp_path / "merged")
    _same_dataset(tmp_path / "merged", single)
